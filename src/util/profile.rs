//! A coarse profiler for training steps (`ALIGN_PROFILE=1`, or `--profile` on `align bench model`
//! and `align train`): wall time per named region, summed over calls and threads. Regions are the
//! phases of a step (`forward/image`, `forward/text`, `loss`, `backward`, `optimizer`) and, inside
//! them, our own ops by kind (`op/depthwise`, `op/depthwise-grad`, `op/batch-norm`,
//! `op/attention`, ...). candle's built-in ops are not timed one by one: what a phase spends
//! outside the named ops is shown as its remainder.
//!
//! Disabled (the default) a region costs one relaxed atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (f64, u64)>> = Mutex::new(BTreeMap::new());

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// On when `enable(true)` was called or `ALIGN_PROFILE` is set to anything but `0`.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub fn init_from_env() {
    if std::env::var("ALIGN_PROFILE").is_ok_and(|v| v != "0" && !v.is_empty()) {
        enable(true);
    }
}

/// Times a region until dropped.
pub struct Region {
    name: &'static str,
    start: Option<Instant>,
}

pub fn region(name: &'static str) -> Region {
    Region { name, start: enabled().then(Instant::now) }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(t) = self.start {
            let mut totals = TOTALS.lock().unwrap();
            let e = totals.entry(self.name).or_insert((0.0, 0));
            e.0 += t.elapsed().as_secs_f64();
            e.1 += 1;
        }
    }
}

/// Runs `f` inside a region.
pub fn timed<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    let _r = region(name);
    f()
}

/// The totals so far (seconds, calls) by region, and clears them.
pub fn take() -> BTreeMap<&'static str, (f64, u64)> {
    std::mem::take(&mut *TOTALS.lock().unwrap())
}

/// A report: each phase with its share of the step, then the named ops under it.
pub fn report(totals: &BTreeMap<&'static str, (f64, u64)>, steps: usize) -> String {
    let steps = steps.max(1) as f64;
    let phases: Vec<(&str, f64)> = totals.iter().filter(|(k, _)| !k.starts_with("op/")).map(|(k, v)| (*k, v.0)).collect();
    let step_total: f64 = phases.iter().filter(|(k, _)| !k.contains('/')).map(|(_, v)| v).sum::<f64>()
        + phases.iter().filter(|(k, _)| k.starts_with("forward/")).map(|(_, v)| v).sum::<f64>();
    let mut out = format!("{:<28} {:>12} {:>8} {:>10}\n", "region", "ms / step", "share", "calls/step");
    let line = |name: &str, secs: f64, calls: f64| {
        format!("{name:<28} {:>12.1} {:>7.1}% {:>10.1}\n", 1000.0 * secs / steps, 100.0 * secs / step_total.max(1e-12), calls / steps)
    };
    for (k, (secs, calls)) in totals.iter().filter(|(k, _)| !k.starts_with("op/")) {
        out.push_str(&line(k, *secs, *calls as f64));
    }
    for (k, (secs, calls)) in totals.iter().filter(|(k, _)| k.starts_with("op/")) {
        out.push_str(&line(&format!("  {k}"), *secs, *calls as f64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_accumulate_only_when_enabled() {
        let _ = take();
        {
            let _r = region("test/off");
        }
        assert!(!take().contains_key("test/off"), "a region was recorded while profiling was off");
        enable(true);
        for _ in 0..3 {
            timed("test/on", || std::thread::sleep(std::time::Duration::from_millis(2)));
        }
        enable(false);
        let t = take();
        let (secs, calls) = t["test/on"];
        assert_eq!(calls, 3);
        assert!(secs >= 0.006);
        assert!(report(&t, 3).contains("test/on"));
    }
}
