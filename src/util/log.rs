//! Console output that cooperates with the active progress bar.
//!
//! Warnings printed with plain `eprintln!` while an indicatif bar is drawing get torn apart by the
//! redraw; routing them through the bar keeps both readable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use indicatif::ProgressBar;

static ACTIVE_BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);
static WARNINGS: AtomicU64 = AtomicU64::new(0);

/// After this many warnings further ones are only counted: a run over a badly broken shard set
/// should not drown its own progress output.
const MAX_WARNING_LINES: u64 = 1000;

pub fn set_active_bar(bar: Option<ProgressBar>) {
    *ACTIVE_BAR.lock().unwrap() = bar;
}

pub fn info(msg: impl AsRef<str>) {
    print_line(msg.as_ref());
}

pub fn warn(msg: impl AsRef<str>) {
    let n = WARNINGS.fetch_add(1, Ordering::Relaxed) + 1;
    if n < MAX_WARNING_LINES {
        print_line(&format!("warning: {}", msg.as_ref()));
    } else if n == MAX_WARNING_LINES {
        print_line("warning: too many warnings; further ones are counted but not printed");
    }
}

fn print_line(line: &str) {
    let guard = ACTIVE_BAR.lock().unwrap();
    match guard.as_ref() {
        Some(bar) if !bar.is_hidden() => bar.println(line),
        _ => eprintln!("{line}"),
    }
}
