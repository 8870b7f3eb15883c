//! Wall-clock times as text: UTC, `YYYY-MM-DDTHH:MM:SSZ`, for log lines and lock files.

/// The current time.
pub fn utc_now() -> String {
    utc(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64)
}

/// Seconds since the epoch.
pub fn utc(secs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, 0)
        .map_or_else(|| format!("{secs} s after the epoch"), |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
}

/// A duration as `1h02m`, `3m05s` or `42s`.
pub fn span(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_spans_by_hand() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!([span(42.4), span(185.0), span(3720.0)], ["42s", "3m05s", "1h02m"]);
    }
}
