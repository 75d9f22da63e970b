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

#[cfg(test)]
mod tests {
    use super::format_bytes;

    #[test]
    fn bytes_are_scaled_to_the_largest_binary_unit() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB (1536 B)");
        assert_eq!(format_bytes(3 << 30), "3.0 GiB (3221225472 B)");
        assert_eq!(format_bytes(u64::MAX), "16.0 EiB (18446744073709551615 B)");
    }
}
