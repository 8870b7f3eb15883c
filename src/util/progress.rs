//! Progress of long work with rate and ETA: an indicatif bar in a terminal; in a batch job's log
//! (stderr not a terminal, where indicatif draws nothing) a line now and then
//! (`ALIGN_LOG_INTERVAL` seconds, default 60) with the position, the rate and the ETA.

use std::sync::Mutex;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use super::log;

pub struct Progress {
    bar: ProgressBar,
    /// Lines for a log file: what is counted, when it started, when the last line went out.
    lines: Option<(String, Instant, Mutex<Instant>)>,
}

/// Seconds between a log file's progress lines.
fn interval() -> f64 {
    std::env::var("ALIGN_LOG_INTERVAL").ok().and_then(|v| v.parse::<f64>().ok()).filter(|v| *v > 0.0).unwrap_or(60.0)
}

impl Progress {
    pub fn bar(len: u64, what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(len) };
        bar.set_style(
            ProgressStyle::with_template("{msg:>20} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, ETA {eta})")
                .expect("valid template"),
        );
        Self::start(bar, what, quiet)
    }

    pub fn spinner(what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new_spinner() };
        bar.set_style(ProgressStyle::with_template("{spinner} {msg:>20} [{elapsed_precise}] {pos} ({per_sec})").expect("valid template"));
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Self::start(bar, what, quiet)
    }

    fn start(bar: ProgressBar, what: &str, quiet: bool) -> Self {
        bar.set_message(what.to_string());
        log::set_active_bar(Some(bar.clone()));
        let lines = (!quiet && !log::interactive()).then(|| (what.to_string(), Instant::now(), Mutex::new(Instant::now())));
        Progress { bar, lines }
    }

    /// No progress lines in a log file: for work that logs its own (training's per-step lines).
    pub fn without_lines(mut self) -> Self {
        self.lines = None;
        self
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        self.maybe_line();
    }

    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
        self.maybe_line();
    }

    fn maybe_line(&self) {
        let Some((what, started, last)) = &self.lines else { return };
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed().as_secs_f64() < interval() {
            return;
        }
        *last = Instant::now();
        let (pos, secs) = (self.bar.position(), started.elapsed().as_secs_f64().max(1e-9));
        let rate = pos as f64 / secs;
        let line = match self.bar.length() {
            Some(len) if len > 0 && rate > 0.0 => format!(
                "{what}: {pos}/{len} ({:.1}%), {rate:.2}/s, ETA {}",
                100.0 * pos as f64 / len as f64,
                super::clock::span(len.saturating_sub(pos) as f64 / rate)
            ),
            _ => format!("{what}: {pos} ({rate:.2}/s)"),
        };
        log::info(line);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
        log::set_active_bar(None);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
            log::set_active_bar(None);
        }
    }
}
