//! Console output through `tracing`: levels from `RUST_LOG` (default `warn,align=info`), lines
//! that cooperate with the active progress bar, and two layouts. In a terminal a line is the
//! message alone (warnings prefixed `warning:`); when stderr is not a terminal (a batch job's log
//! file), every line starts with its UTC time and level, and long work prints a line now and then
//! instead of drawing a bar (`util::progress`).
//!
//! Warnings printed with plain `eprintln!` while an indicatif bar is drawing get torn apart by the
//! redraw; routing every line through the bar keeps both readable.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use indicatif::ProgressBar;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

static ACTIVE_BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);
static WARNINGS: AtomicU64 = AtomicU64::new(0);

/// After this many warnings further ones are only counted: a run over a badly broken shard set
/// should not drown its own progress output.
const MAX_WARNING_LINES: u64 = 1000;

pub fn set_active_bar(bar: Option<ProgressBar>) {
    *ACTIVE_BAR.lock().unwrap() = bar;
}

/// Whether stderr is a terminal (bars drawn) rather than a log file (timestamped lines).
pub fn interactive() -> bool {
    std::io::stderr().is_terminal()
}

/// Installs the subscriber (once; a second call, or one in a process that has its own, does
/// nothing). Without it (library use, tests) the lines still reach stderr, unformatted.
pub fn init() {
    // align's own lines at info; the libraries' (candle, tokenizers, hf-hub) only when they warn.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn,align=info"));
    let subscriber =
        tracing_subscriber::fmt().with_env_filter(filter).event_format(Lines { stamped: !interactive() }).with_writer(BarWriter).finish();
    let _ = tracing::subscriber::set_global_default(subscriber);
}

pub fn info(msg: impl AsRef<str>) {
    emit(Level::INFO, msg.as_ref());
}

pub fn warn(msg: impl AsRef<str>) {
    let n = WARNINGS.fetch_add(1, Ordering::Relaxed) + 1;
    if n < MAX_WARNING_LINES {
        emit(Level::WARN, msg.as_ref());
    } else if n == MAX_WARNING_LINES {
        emit(Level::WARN, "too many warnings; further ones are counted but not printed");
    }
}

/// Lines shown for one problem of one shard before the rest are only counted.
const PER_SHARD_REASON: u64 = 3;

/// A skipped sample's warning: the first few for each shard and reason are shown, then one line
/// says the rest are counted (a shard of 10,000 captionless samples is a few lines, not 10,000;
/// the counts by reason are in the command's summary).
pub fn warn_sample(shard: &str, reason: &str, msg: impl AsRef<str>) {
    static SEEN: std::sync::Mutex<Option<std::collections::HashMap<(String, String), u64>>> = std::sync::Mutex::new(None);
    let n = {
        let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
        let count = seen.get_or_insert_with(Default::default).entry((shard.to_string(), reason.to_string())).or_insert(0);
        *count += 1;
        *count
    };
    if n <= PER_SHARD_REASON {
        warn(msg);
    } else if n == PER_SHARD_REASON + 1 {
        warn(format!("shard {shard}: more samples skipped for {reason}; counted in the summary, not shown"));
    }
}

fn emit(level: Level, msg: &str) {
    if !tracing::dispatcher::has_been_set() {
        // No subscriber: straight to stderr, as a terminal shows it.
        print_line(&if level == Level::WARN { format!("warning: {msg}") } else { msg.to_string() });
        return;
    }
    match level {
        Level::WARN => tracing::warn!(target: "align", "{msg}"),
        _ => tracing::info!(target: "align", "{msg}"),
    }
}

fn print_line(line: &str) {
    let guard = ACTIVE_BAR.lock().unwrap();
    match guard.as_ref() {
        Some(bar) if !bar.is_hidden() => bar.println(line),
        _ => eprintln!("{line}"),
    }
}

/// A line per event: `warning: message` in a terminal, `TIME LEVEL message` in a log file.
struct Lines {
    stamped: bool,
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let level = *event.metadata().level();
        if self.stamped {
            write!(writer, "{} {:<5} ", crate::util::clock::utc_now(), level)?;
        } else if level == Level::WARN {
            write!(writer, "warning: ")?;
        } else if level == Level::ERROR {
            write!(writer, "error: ")?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Writes each formatted line through the active progress bar (above it), else to stderr.
struct BarWriter;

struct LineBuffer(Vec<u8>);

impl std::io::Write for LineBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineBuffer {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.0);
        for line in text.lines() {
            print_line(line);
        }
    }
}

impl<'a> MakeWriter<'a> for BarWriter {
    type Writer = LineBuffer;

    fn make_writer(&'a self) -> Self::Writer {
        LineBuffer(Vec::new())
    }
}
