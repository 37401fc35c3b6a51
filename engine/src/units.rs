//! Byte sizes as people write them ("6GiB", "512MiB", "96GB", "1.5GiB") and
//! as we print them. Shared by every binary that takes a memory flag.

/// Parses a size: a number and a unit (case-insensitive), as memory flags
/// take it. GB, MB, KB and TB are decimal (1 GB = 10^9 bytes), as disk and
/// GPU makers and [`parse_rate`] count; GiB, MiB, KiB and TiB binary
/// (1 GiB = 2^30 bytes), as memory is counted and [`fmt_bytes`] prints.
/// The bare letters G, M, K and T are binary, as llama.cpp and docker read
/// them (`2G` = 2 GiB); B is bytes.
///
/// A number without a unit is refused ("96" was once 96 bytes, never what
/// was meant), saying how to write it; only `0` may go without one.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (value, unit) = number_and_unit(s)
        .ok_or_else(|| format!("'{s}' is not a size: expected a number and a unit, like 6GiB"))?;
    let mult: f64 = match unit.as_str() {
        "" if value == 0.0 => 0.0,
        "" => {
            let n = s.trim();
            return Err(format!(
                "'{n}' has no unit: write {n}GiB or {n}GB (GB = 10^9 bytes, GiB = 2^30)"
            ));
        }
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "k" | "kib" => 1024.0,
        "m" | "mib" => (1u64 << 20) as f64,
        "g" | "gib" => (1u64 << 30) as f64,
        "t" | "tib" => (1u64 << 40) as f64,
        other => {
            return Err(format!(
                "'{s}': unknown unit '{other}' (use GB = 10^9 bytes or GiB = 2^30; likewise B, KB/KiB, MB/MiB, TB/TiB)"
            ))
        }
    };
    // Rounded: 0.3GB is 299999999.99999997 in floating point.
    let bytes = (value * mult).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(bytes as u64)
}

/// "6.5 GiB" -> (6.5, "gib"): the leading number and the lower-cased unit after it.
fn number_and_unit(s: &str) -> Option<(f64, String)> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    Some((num.parse().ok()?, unit.trim().to_ascii_lowercase()))
}

/// Parses a rate in bytes per second, as bandwidth is written ("40GB/s",
/// "900 GB/s", "1.5TB/s", "25GiB/s"): KB, MB, GB and TB are decimal here
/// (1 GB/s = 10^9 bytes/s, as `omnictl workers` prints rates); KiB, MiB,
/// GiB and TiB binary.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let not_a_rate = || format!("'{s}' is not a rate: expected bytes per second, like 40GB/s");
    let per_s = s.trim().strip_suffix("/s").ok_or_else(not_a_rate)?;
    let (value, unit) = number_and_unit(per_s).ok_or_else(not_a_rate)?;
    let mult: f64 = match unit.as_str() {
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => (1u64 << 30) as f64,
        "tib" => (1u64 << 40) as f64,
        other => {
            return Err(format!(
                "'{s}': unknown unit '{other}' (use B/s, MB/s, GB/s, TB/s or GiB/s)"
            ))
        }
    };
    let rate = value * mult;
    if !rate.is_finite() || rate < 1.0 || rate > u64::MAX as f64 {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(rate as u64)
}

/// "41.2 GiB", "512.0 MiB", "12.0 KiB", "100 B".
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if b >= size {
            return format!("{:.1} {name}", b as f64 / size as f64);
        }
    }
    format!("{b} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("6GiB").unwrap(), 6 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2 tib").unwrap(), 2 << 40);
        // GB and friends are decimal, as parse_rate reads them.
        assert_eq!(parse_size("96GB").unwrap(), 96_000_000_000);
        assert_eq!(parse_size("1.5 gb").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_size("4KB").unwrap(), 4_000);
        assert_eq!(parse_size("0.3GB").unwrap(), 300_000_000);
        assert_eq!(parse_size("1TB").unwrap(), 1_000_000_000_000);
        // The bare letters are binary, as llama.cpp and docker read them.
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("100B").unwrap(), 100);
        // Zero needs no unit; any other number does.
        assert_eq!(parse_size("0").unwrap(), 0);
        for bare in ["96", "100", " 32 ", "1.5"] {
            let e = parse_size(bare).unwrap_err();
            let n = bare.trim();
            assert!(
                e.contains(&format!("'{n}' has no unit: write {n}GiB or {n}GB"))
                    && e.contains("GB = 10^9 bytes, GiB = 2^30"),
                "{bare}: {e}"
            );
        }
        assert!(parse_size("lots").unwrap_err().contains("'lots'"));
        let e = parse_size("5 parsecs").unwrap_err();
        assert!(
            e.contains("unknown unit 'parsecs'") && e.contains("GB = 10^9 bytes or GiB = 2^30"),
            "{e}"
        );
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_bytes(100), "100 B");
        assert_eq!(parse_rate("40GB/s").unwrap(), 40_000_000_000);
        assert_eq!(parse_rate("1.5 TB/s").unwrap(), 1_500_000_000_000);
        assert_eq!(parse_rate("2GiB/s").unwrap(), 2 << 30);
        for (bad, says) in [
            ("40GB", "bytes per second"),
            ("fast/s", "not a rate"),
            ("0GB/s", "out of range"),
            ("4 parsecs/s", "unknown unit"),
        ] {
            let e = parse_rate(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains(says), "{bad}: {e}");
        }
    }
}
