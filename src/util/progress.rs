//! indicatif progress bars with rate and ETA, hidden when quiet or when stderr is not a terminal
//! is not our concern (indicatif draws nothing then).

use indicatif::{ProgressBar, ProgressStyle};

use super::log;

pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn bar(len: u64, what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(len) };
        bar.set_style(
            ProgressStyle::with_template("{msg:>20} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, ETA {eta})")
                .expect("valid template"),
        );
        bar.set_message(what.to_string());
        log::set_active_bar(Some(bar.clone()));
        Progress { bar }
    }

    pub fn spinner(what: &str, quiet: bool) -> Self {
        let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new_spinner() };
        bar.set_style(ProgressStyle::with_template("{spinner} {msg:>20} [{elapsed_precise}] {pos} ({per_sec})").expect("valid template"));
        bar.set_message(what.to_string());
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        log::set_active_bar(Some(bar.clone()));
        Progress { bar }
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
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
