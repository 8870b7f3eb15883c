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

/// A rate to three significant figures, thousands grouped: `2,689/s`, `42.3/s`, `0.427/s`.
pub fn rate(per_s: f64) -> String {
    if !per_s.is_finite() || per_s <= 0.0 {
        return "-/s".into();
    }
    if per_s >= 999.5 {
        let n = per_s.round() as u64;
        let digits = n.to_string();
        let mut grouped = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                grouped.push(',');
            }
            grouped.push(c);
        }
        return format!("{grouped}/s");
    }
    let decimals = if per_s >= 99.95 {
        0
    } else if per_s >= 9.995 {
        1
    } else if per_s >= 0.9995 {
        2
    } else {
        3
    };
    format!("{per_s:.decimals$}/s")
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).expect("valid template").with_key(
        "rate",
        |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
            let _ = w.write_str(&rate(s.per_sec()));
        },
    )
}

impl Progress {
    pub fn bar(len: u64, what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(len) };
        bar.set_style(style("{msg:>20} [{elapsed_precise}] {wide_bar} {pos}/{len} ({rate}, ETA {eta})"));
        Self::start(bar, what, quiet)
    }

    /// A bar whose message is a status that changes (training's loss and rate): the status comes
    /// last and is cut to the terminal's width, so the bar keeps its cells on 80 columns.
    pub fn with_status(len: u64, what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(len) };
        bar.set_style(style("[{elapsed_precise}] {bar:24} {pos}/{len} ({rate}, ETA {eta}) {wide_msg}"));
        Self::start(bar, what, quiet)
    }

    pub fn spinner(what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new_spinner() };
        bar.set_style(style("{spinner} {msg:>20} [{elapsed_precise}] {pos} ({rate})"));
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
                "{what}: {pos}/{len} ({:.1}%), {}, ETA {}",
                100.0 * pos as f64 / len as f64,
                self::rate(rate),
                super::clock::span(len.saturating_sub(pos) as f64 / rate)
            ),
            _ => format!("{what}: {pos} ({})", self::rate(rate)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_a_person_writes_them() {
        let got: Vec<String> = [2689.2798, 1_234_567.0, 999.6, 142.6, 42.34, 4.266, 0.4266, 0.0].into_iter().map(rate).collect();
        assert_eq!(got, ["2,689/s", "1,234,567/s", "1,000/s", "143/s", "42.3/s", "4.27/s", "0.427/s", "-/s"]);
    }
}
