//! Learning-rate schedules. Step `s` is the 0-based index of the update about to be made.

pub use crate::config::ScheduleKind;

pub fn lr_at(step: u64, base: f64, warmup: u64, total: u64, kind: ScheduleKind) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    match kind {
        ScheduleKind::Linear => base * (1.0 - progress),
        ScheduleKind::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        ScheduleKind::Constant => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_schedule_by_hand() {
        // Warm up to 1e-3 over 10 steps, decay to zero at 110.
        assert!((lr_at(0, 1e-3, 10, 110, ScheduleKind::Linear) - 1e-4).abs() < 1e-15);
        assert!((lr_at(9, 1e-3, 10, 110, ScheduleKind::Linear) - 1e-3).abs() < 1e-15);
        assert!((lr_at(10, 1e-3, 10, 110, ScheduleKind::Linear) - 1e-3).abs() < 1e-15);
        assert!((lr_at(60, 1e-3, 10, 110, ScheduleKind::Linear) - 5e-4).abs() < 1e-15);
        assert_eq!(lr_at(110, 1e-3, 10, 110, ScheduleKind::Linear), 0.0);
    }

    #[test]
    fn cosine_is_half_way_at_the_middle() {
        assert!((lr_at(60, 1.0, 10, 110, ScheduleKind::Cosine) - 0.5).abs() < 1e-12);
        assert!(lr_at(110, 1.0, 10, 110, ScheduleKind::Cosine).abs() < 1e-12);
        assert_eq!(lr_at(500, 2.0, 10, 110, ScheduleKind::Constant), 2.0);
    }
}
