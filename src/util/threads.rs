//! How the training process shares the CPU between the compute threads (rayon's pool, which
//! candle's CPU kernels and our ops run on) and the loader's decode threads.
//!
//! By default compute gets every core and the loader threads run at a lower scheduling priority:
//! they still use every cycle compute leaves idle (its barriers, its single-threaded stretches),
//! but a decode never delays a step's matmul. `train.compute_threads` caps the compute pool, to
//! leave cores to the loader outright (or to share a machine).

/// Sizes rayon's global pool, once, before anything has used it. `0` keeps rayon's default (one
/// thread per core, or `RAYON_NUM_THREADS`). Returns the compute thread count in effect.
pub fn set_compute_threads(n: usize) -> usize {
    if n > 0 {
        if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global() {
            let now = rayon::current_num_threads();
            if now != n {
                crate::util::log::warn(format!("train.compute_threads = {n} not applied ({e}); computing on {now} threads"));
            }
        }
    }
    rayon::current_num_threads()
}

/// Lowers the calling thread's scheduling priority by `nice` (Linux `setpriority` on the thread
/// id; elsewhere, and for `nice == 0`, nothing happens). Failure is harmless and silent: the
/// thread then simply competes as an equal.
pub fn lower_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    if nice != 0 {
        // SAFETY: plain system calls on the calling thread's own id.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            let current = libc::getpriority(libc::PRIO_PROCESS, tid);
            libc::setpriority(libc::PRIO_PROCESS, tid, (current + nice).clamp(-20, 19));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// This thread's nice value (Linux), for tests and the run header.
#[cfg(target_os = "linux")]
pub fn current_nice() -> i32 {
    // SAFETY: as above.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::syscall(libc::SYS_gettid) as libc::id_t) }
}

/// How many of the training loader's decode threads are at work: started and not waiting for
/// room in their full queue. Idle compute threads keep their cores only while none is.
static LOADER_AT_WORK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Held by a loader thread for as long as it runs; [`LoaderAtWork::waiting`] marks its waits.
pub struct LoaderAtWork(());

impl LoaderAtWork {
    pub fn enter() -> Self {
        LOADER_AT_WORK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        LoaderAtWork(())
    }

    /// Runs `wait` (a send into a queue that may be full) with this thread counted as idle.
    pub fn waiting<R>(&self, wait: impl FnOnce() -> R) -> R {
        LOADER_AT_WORK.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let r = wait();
        LOADER_AT_WORK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        r
    }
}

impl Drop for LoaderAtWork {
    fn drop(&mut self) {
        LOADER_AT_WORK.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether any loader thread is decoding now (or has work to get on with).
pub fn loader_at_work() -> bool {
    LOADER_AT_WORK.load(std::sync::atomic::Ordering::Relaxed) > 0
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn lowering_the_priority_affects_only_the_calling_thread() {
        let before = current_nice();
        let inside = std::thread::spawn(|| {
            let start = current_nice();
            lower_priority(5);
            (start, current_nice())
        })
        .join()
        .unwrap();
        assert_eq!(inside.1, (inside.0 + 5).min(19));
        assert_eq!(current_nice(), before, "the caller's own priority must not change");
    }

    #[test]
    fn a_loader_thread_is_at_work_while_it_holds_its_mark() {
        // Only the true side is checked: the count is the process's, shared with other tests.
        let (tx, rx) = std::sync::mpsc::sync_channel(0);
        let worker = std::thread::spawn(move || {
            let at_work = LoaderAtWork::enter();
            let before = loader_at_work();
            at_work.waiting(|| tx.send(()).unwrap());
            before && loader_at_work()
        });
        rx.recv().unwrap();
        assert!(worker.join().unwrap());
    }
}
