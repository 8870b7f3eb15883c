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
    rayon::scope(|_| products.run(f))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kernels::bf16_gemm::{available, with_bf16_products, Scope};

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
}
