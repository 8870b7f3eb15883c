//! Where a model's CPU compute runs from: a thread of rayon's global pool, the pool every op's
//! parallel regions use.

/// Runs `f` on one of the compute pool's threads (directly if the caller is one), with the
/// caller's bf16 product setting carried over. For a training step or a forward pass: from any
/// other thread, each of a step's many parallel regions is handed to the pool while the
/// caller sleeps until it is done, so every region pays for waking a worker and then the
/// caller, and between regions the caller's serial work competes with the idle workers' spins
/// for the cores. From a pool thread the regions split by work stealing, the caller taking its
/// share. On two cores, medians of alternating runs against calling from the main thread:
/// EfficientNet-B0 + BERT-mini steps 10-11% faster, ViT-Ti/8 + BERT-tiny 3-4%, ViT-Ti/16 +
/// BERT-mini 4% in bf16 and 1% in f32, ViT-B/32 embedding 2-4%. With another busy process on
/// the cores the steps moved by −1% to −4%, inside their spread under that load.
///
/// `f` must not wait for other threads that need the pool (a channel fed by a reader that
/// decodes on the pool, another rank's step at a barrier): with every pool thread so waiting,
/// nothing would run.
pub fn on_compute_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let products = super::kernels::bf16_gemm::Scope::current();
    // rayon::scope runs its closure on a pool thread when called from outside the pool.
    rayon::scope(|_| {
        let _awake = KeepAwake::start();
        products.run(f)
    })
}

/// `f` on the compute pool where `device` is the CPU (as [`on_compute_pool`]), on the calling
/// thread for a GPU, whose kernels do not run on the pool.
pub fn compute_on<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() {
        on_compute_pool(f)
    } else {
        f()
    }
}

/// The longest a kept-awake thread spins without finding work before it goes back to rayon,
/// which puts it to sleep: longer than the serial stretches inside a step (with 2 ms, a ViT-Ti/16
/// step's pool threads still slept 3,000-5,600 times a run, as without spinning), short enough
/// that a thread does not hold its core long after the work has moved elsewhere.
const AWAKE_FOR: std::time::Duration = std::time::Duration::from_millis(50);

/// Keeps the pool's other threads looking for work while one thread runs a step or a forward
/// pass, as OpenMP's threads spin between parallel regions. Left to rayon, an idle thread sleeps
/// after about 70 µs (33 rounds of yields), shorter than many of a step's serial stretches, so
/// each next region has to wake it, and a join whose other half is late waits longer still. On
/// two Zen 5 cores, alternating runs of a ViT-Ti/16 + BERT-mini f32 step went from 23-27 to 32-37
/// samples/s (4,200-5,900 sleeps a run down to 190-500), a ViT-B/32 bf16 embedding from 49-53 to
/// 58-59 images/s; in sittings where waking was quick both sides ran alike. Each other thread
/// runs one spinning job that takes work as it appears ([`rayon::yield_now`]) until the caller
/// is done, or until [`AWAKE_FOR`] passes with none, or while the training loader's threads are
/// decoding: they run at a lower priority and need the cores the pool leaves idle.
struct KeepAwake(std::sync::Arc<Spinners>);

#[derive(Default)]
struct Spinners {
    done: std::sync::atomic::AtomicBool,
    /// Threads spinning now (for the tests).
    spinning: std::sync::atomic::AtomicUsize,
    /// Threads that have started to spin (for the tests).
    started: std::sync::atomic::AtomicUsize,
}

impl KeepAwake {
    /// Called on the pool thread that runs the caller's work.
    fn start() -> Self {
        Self::start_unless(crate::util::threads::loader_at_work, AWAKE_FOR)
    }

    /// No thread spins while `yield_cores` holds, and one that spins stops when it starts to or
    /// when `awake_for` passes without work.
    fn start_unless(yield_cores: fn() -> bool, awake_for: std::time::Duration) -> Self {
        let spinners = std::sync::Arc::new(Spinners::default());
        if rayon::current_num_threads() > 1 && !yield_cores() {
            let owner = rayon::current_thread_index();
            let shared = spinners.clone();
            // A broadcast job goes to each thread's own queue, so the owner cannot take another
            // thread's spinner while it waits at a join (it gets its own copy, which returns).
            rayon::spawn_broadcast(move |ctx| {
                if Some(ctx.index()) != owner {
                    shared.spin_for_work(yield_cores, awake_for);
                }
            });
        }
        KeepAwake(spinners)
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.0.done.store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Spinners {
    fn spin_for_work(&self, yield_cores: fn() -> bool, awake_for: std::time::Duration) {
        use std::sync::atomic::Ordering;
        self.started.fetch_add(1, Ordering::Relaxed);
        self.spinning.fetch_add(1, Ordering::Relaxed);
        let mut last_work = std::time::Instant::now();
        while !self.done.load(Ordering::Acquire) {
            if let Some(rayon::Yield::Executed) = rayon::yield_now() {
                last_work = std::time::Instant::now();
                continue;
            }
            if last_work.elapsed() > awake_for || yield_cores() {
                break;
            }
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
        self.spinning.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::bf16_gemm::{available, with_bf16_products, Scope};
    use rayon::prelude::*;

    #[test]
    fn compute_runs_on_a_pool_thread_with_the_callers_products() {
        assert_eq!(rayon::current_thread_index(), None, "tests run outside the pool");
        let (on_pool, products) = on_compute_pool(|| (rayon::current_thread_index().is_some(), Scope::current()));
        assert!(on_pool && !products.is_on());
        let products = with_bf16_products(|| on_compute_pool(Scope::current));
        assert_eq!(products.is_on(), available());
        // From a pool thread it runs in place.
        let same_thread = on_compute_pool(|| {
            let outer = rayon::current_thread_index();
            on_compute_pool(|| rayon::current_thread_index() == outer)
        });
        assert!(same_thread);
        assert_eq!(on_compute_pool(|| 7), 7);
        assert!(compute_on(&candle_core::Device::Cpu, || rayon::current_thread_index().is_some()));
    }

    /// Waits up to 10 s for `cond`.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < until, "not within 10 s: {what}");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    #[test]
    fn the_other_threads_spin_until_the_caller_is_done_idle_too_long_or_the_loader_works() {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        use std::time::Duration;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let hour = Duration::from_secs(3600);
        pool.install(|| {
            // Every thread but the caller's spins, and stops once the caller is done.
            let awake = KeepAwake::start_unless(|| false, hour);
            let spinners = awake.0.clone();
            eventually("two threads spinning", || spinners.spinning.load(Relaxed) == 2);
            // Work appearing is taken while they spin, and they go on spinning.
            let sum: u64 = (0..1000u64).into_par_iter().map(|i| i * i).sum();
            assert_eq!(sum, 332_833_500);
            assert_eq!(spinners.spinning.load(Relaxed), 2);
            drop(awake);
            eventually("spinners stopped", || spinners.spinning.load(Relaxed) == 0);
            assert_eq!(spinners.started.load(Relaxed), 2, "the caller's own thread never spins");

            // Without work they stop on their own.
            let awake = KeepAwake::start_unless(|| false, Duration::from_millis(1));
            let spinners = awake.0.clone();
            eventually("two started", || spinners.started.load(Relaxed) == 2);
            eventually("idle spinners stopped", || spinners.spinning.load(Relaxed) == 0);
            drop(awake);

            // None starts while the loader decodes, and they stop when it starts to.
            let awake = KeepAwake::start_unless(|| true, hour);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(awake.0.started.load(Relaxed), 0);
            drop(awake);
            static DECODING: AtomicBool = AtomicBool::new(false);
            let awake = KeepAwake::start_unless(|| DECODING.load(Relaxed), hour);
            let spinners = awake.0.clone();
            eventually("two threads spinning", || spinners.spinning.load(Relaxed) == 2);
            DECODING.store(true, Relaxed);
            eventually("spinners gave way to the loader", || spinners.spinning.load(Relaxed) == 0);
            drop(awake);
        });
    }
}
