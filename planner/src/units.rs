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

#[cfg(test)]
mod tests {
    use super::{format_bytes, format_seconds};

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
