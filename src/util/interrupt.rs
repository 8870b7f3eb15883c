//! Stopping a long run cleanly: Ctrl-C (SIGINT), SIGTERM (SLURM's time limit and preemption,
//! Kubernetes, `kill`) and SIGUSR1 (SLURM's `--signal=USR1@SECONDS`, sent ahead of the limit)
//! ask the training loop to stop at the next step boundary: it saves a checkpoint, prints its
//! summary and exits with status 128 + the signal's number (130, 143, 138), so a job script knows
//! the run stopped early and a requeued job continues it with `--resume`. A second signal of any
//! of these quits at once, which is safe because checkpoints are only ever replaced atomically.

use std::sync::atomic::{AtomicI32, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};

/// The first stop signal received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// When the first stop signal arrived.
static RECEIVED_AT: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// What must happen before the process quits at a second signal (killing the pipe commands
/// that feed the loader, which would outlive it).
static BEFORE_EXIT: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Runs `f` before the process quits at a second signal (set once).
pub fn before_exit(f: fn()) {
    let _ = BEFORE_EXIT.set(f);
}

/// Runs what [`before_exit`] set, for any early exit of the process.
pub fn run_before_exit() {
    if let Some(f) = BEFORE_EXIT.get() {
        f();
    }
}

/// Installs the handler (once per process; later calls do nothing).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR1]) {
            Ok(s) => s,
            Err(e) => {
                crate::util::log::warn(format!("signals will not save a checkpoint: {e}"));
                return;
            }
        };
        let spawned = std::thread::Builder::new().name("signals".into()).spawn(move || {
            for signal in signals.forever() {
                let _ = RECEIVED_AT.set(std::time::Instant::now());
                if RECEIVED.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                    eprintln!("\n{} again: quitting now", name(signal));
                    run_before_exit();
                    std::process::exit(128 + signal);
                }
                eprintln!("\n{}: stopping after this step and saving a checkpoint (send it again to quit at once)", name(signal));
            }
        });
        if let Err(e) = spawned {
            crate::util::log::warn(format!("signals will not save a checkpoint: {e}"));
        }
    });
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    received().is_some()
}

/// How long ago the stop was asked for.
pub fn requested_for() -> Option<std::time::Duration> {
    RECEIVED_AT.get().map(|t| t.elapsed())
}

/// The signal that asked for the stop.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The exit status of a run that a signal stopped: 128 + its number, as a shell reports it.
pub fn exit_status(signal: i32) -> i32 {
    128 + signal
}

pub fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "interrupt (SIGINT)",
        SIGTERM => "SIGTERM",
        SIGUSR1 => "SIGUSR1",
        _ => "signal",
    }
}
