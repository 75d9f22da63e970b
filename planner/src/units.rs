//! Human-readable quantities.

/// `1536` -> `1.5 KiB (1536 B)`; below 1 KiB just `N B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut scaled = bytes as f64 / 1024.0;
    let mut unit = 0;
    while scaled >= 1024.0 && unit + 1 < UNITS.len() {
        scaled /= 1024.0;
        unit += 1;
    }
    format!("{scaled:.1} {} ({bytes} B)", UNITS[unit])
}

/// `bytes` in the largest binary unit that keeps an integer part, to one decimal without a
/// trailing `.0`: `141 GiB`, `12.5 GiB`, `0 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut scaled = bytes as f64;
    let mut unit = 0;
    while scaled >= 1024.0 && unit + 1 < UNITS.len() {
        scaled /= 1024.0;
        unit += 1;
    }
    let text = format!("{scaled:.1}");
    let text = text.strip_suffix(".0").unwrap_or(&text);
    format!("{text} {}", UNITS[unit])
}

/// Seconds in the unit that keeps 1-3 integer digits: `1.50 ms`, `12.0 µs`, `0 s`.
pub fn format_seconds(seconds: f64) -> String {
    const UNITS: [(f64, &str); 4] = [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")];
    if seconds == 0.0 || !seconds.is_finite() {
        return format!("{seconds} s");
    }
    let (scale, unit) = UNITS
        .iter()
        .copied()
        .find(|(scale, _)| seconds.abs() >= *scale)
        .unwrap_or(UNITS[UNITS.len() - 1]);
    format!("{:.3} {unit}", seconds / scale)
}

/// Binary and decimal size units, as `parse_bytes` reads them (lower case) and the output
/// prints the binary ones.
const SIZE_UNITS: [(&str, f64); 14] = [
    ("b", 1.0),
    ("kib", 1024.0),
    ("mib", 1_048_576.0),
    ("gib", 1_073_741_824.0),
    ("tib", 1_099_511_627_776.0),
    ("pib", 1_125_899_906_842_624.0),
    ("eib", 1_152_921_504_606_846_976.0),
    ("kb", 1e3),
    ("mb", 1e6),
    ("gb", 1e9),
    ("tb", 1e12),
    ("pb", 1e15),
    ("eb", 1e18),
    ("", 1.0),
];

/// Parses a size: `40GiB`, `512 MiB`, `1.5GB`, `4096` (bytes). Binary (`KiB`..`EiB`) and
/// decimal (`KB`..`EB`) units, case-insensitive; at least 1 byte and below 2^64.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (try `40GiB`)"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let Some(&(_, scale)) = SIZE_UNITS.iter().find(|(name, _)| *name == unit) else {
        return Err(format!(
            "unknown size unit `{unit}` in `{text}` (units: B, KiB, MiB, GiB, TiB, PiB, EiB, KB, MB, GB, TB, PB, EB)"
        ));
    };
    let bytes = (number * scale).round();
    if !(bytes.is_finite() && bytes < u64::MAX as f64) {
        return Err(format!("`{text}` is too large (the limit is 16 EiB)"));
    }
    if bytes < 1.0 {
        return Err(format!("`{text}` is not a positive size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::{format_bytes, format_seconds, format_size, parse_bytes};

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("40GiB"), Ok(40 << 30));
        assert_eq!(parse_bytes("1.5 KiB"), Ok(1536));
        assert_eq!(parse_bytes("2gb"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("1e300").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("-1GiB").is_err());
    }

    #[test]
    fn every_unit_the_output_prints_parses_back() {
        for bytes in [1u64 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50, 1 << 60] {
            let printed = format_bytes(bytes);
            let short = printed.split(" (").next().unwrap();
            assert_eq!(parse_bytes(short), Ok(bytes), "{printed}");
        }
        assert_eq!(parse_bytes("1PiB"), Ok(1 << 50));
        assert_eq!(parse_bytes("2 EB"), Ok(2_000_000_000_000_000_000));
    }

    #[test]
    fn short_sizes_drop_a_zero_decimal_and_parse_back() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(141 << 30), "141 GiB");
        assert_eq!(format_size(12 * (1 << 30) + (1 << 29)), "12.5 GiB");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(parse_bytes(&format_size(80 << 30)), Ok(80 << 30));
    }

    #[test]
    fn seconds_use_the_largest_unit_below_them() {
        assert_eq!(format_seconds(0.0), "0 s");
        assert_eq!(format_seconds(2.5), "2.500 s");
        assert_eq!(format_seconds(0.0015), "1.500 ms");
        assert_eq!(format_seconds(1.2e-5), "12.000 µs");
        assert_eq!(format_seconds(3e-11), "0.030 ns");
    }

    #[test]
    fn bytes_are_scaled_to_the_largest_binary_unit() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB (1536 B)");
        assert_eq!(format_bytes(3 << 30), "3.0 GiB (3221225472 B)");
        assert_eq!(format_bytes(u64::MAX), "16.0 EiB (18446744073709551615 B)");
    }
}
