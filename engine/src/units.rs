//! Byte sizes as people write them ("6GiB", "512MiB", "2G", "1.5GiB") and
//! as we print them. Shared by every binary that takes a memory flag.

/// Parses a size: a number with an optional unit (B, K/KB/KiB, M/MB/MiB,
/// G/GB/GiB, T/TB/TiB; case-insensitive). Units are binary (1K = 1024),
/// as memory is counted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (value, unit) = number_and_unit(s)
        .ok_or_else(|| format!("'{s}' is not a size: expected a number and a unit, like 6GiB"))?;
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "'{s}': unknown unit '{other}' (use B, KiB, MiB, GiB or TiB)"
            ))
        }
    };
    let bytes = value * mult as f64;
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
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("lots").unwrap_err().contains("'lots'"));
        assert!(parse_size("5 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
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
