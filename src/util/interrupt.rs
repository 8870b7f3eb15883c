//! Ctrl-C for long runs: the first press asks the training loop to stop at the next step
//! boundary (it saves a checkpoint and prints its summary); a second press quits at once, which
//! is safe because checkpoints are only ever replaced atomically.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Installs the handler (once per process; later calls do nothing).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let installed = ctrlc::set_handler(|| {
            if REQUESTED.swap(true, Ordering::SeqCst) {
                eprintln!("\ninterrupted again: quitting now");
                std::process::exit(130);
            }
            eprintln!("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to quit at once)");
        });
        if let Err(e) = installed {
            crate::util::log::warn(format!("Ctrl-C will not save a checkpoint: {e}"));
        }
    });
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
