//! How people write layers, one form everywhere: a range is read as
//! `8-11` (inclusive, as people count layers), `8..12` (half-open, as Rust
//! and our older output wrote it), `8..=11` or `8`, and always printed as
//! `8-11` (or `8` for one layer). Shared by every command that takes or
//! shows layers so a range printed by one can be pasted into another.

use std::ops::Range;

/// Parses a layer range: `8-11`, `8..12`, `8..=11` or `8`.
pub fn parse_layers(s: &str) -> Result<Range<u32>, String> {
    let t = s.trim();
    let num = |x: &str| {
        x.trim().parse::<u32>().map_err(|_| {
            format!("'{s}' is not a layer range: write it like 8-11 (layers 8 to 11) or 8..12")
        })
    };
    let (start, end) = if let Some((a, b)) = t.split_once("..=") {
        (
            num(a)?,
            num(b)?
                .checked_add(1)
                .ok_or_else(|| format!("'{s}' is out of range"))?,
        )
    } else if let Some((a, b)) = t.split_once("..") {
        (num(a)?, num(b)?)
    } else if let Some((a, b)) = t.split_once('-') {
        (
            num(a)?,
            num(b)?
                .checked_add(1)
                .ok_or_else(|| format!("'{s}' is out of range"))?,
        )
    } else {
        let a = num(t)?;
        (a, a + 1)
    };
    if end <= start {
        return Err(format!(
            "'{s}' holds no layer: the range ends before it starts"
        ));
    }
    Ok(start..end)
}

/// Prints a layer range the one way: `8-11`, `8` for one layer, `none`
/// for an empty one.
pub fn fmt_layers(r: &Range<u32>) -> String {
    match r.end.saturating_sub(r.start) {
        0 => "none".into(),
        1 => r.start.to_string(),
        _ => format!("{}-{}", r.start, r.end - 1),
    }
}

/// `n` things as said: "1 sequence", "8 sequences" (the plural by adding
/// an s, which every word we count takes).
pub fn count(n: impl Into<u64>, word: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_written_form_reads_as_the_same_range_and_prints_one_way() {
        for s in ["8-11", "8..12", "8..=11", " 8 - 11 "] {
            assert_eq!(parse_layers(s).unwrap(), 8..12, "{s}");
        }
        assert_eq!(parse_layers("5").unwrap(), 5..6);
        assert_eq!(fmt_layers(&(8..12)), "8-11");
        assert_eq!(fmt_layers(&(5..6)), "5");
        assert_eq!(fmt_layers(&(3..3)), "none");
        // What is printed reads back as the same range.
        for r in [0..1, 0..24, 7..18] {
            assert_eq!(parse_layers(&fmt_layers(&r)).unwrap(), r);
        }
        assert_eq!(count(1u32, "sequence"), "1 sequence");
        assert_eq!(count(8u32, "sequence"), "8 sequences");
        for bad in ["", "x", "8-", "11-8", "8..8", "-3", "8..x"] {
            let e = parse_layers(bad).unwrap_err();
            assert!(e.contains(&format!("'{bad}'")), "{bad}: {e}");
        }
    }
}
