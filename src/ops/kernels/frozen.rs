//! Weights a forward-only command holds unchanged while it runs, and the packed forms the
//! product kernels make of them (int8 panels with their scales, bf16 panels), each made on the
//! first product that reads it and kept. Packing a weight costs a pass over it per product: a
//! text tower that runs a batch as several length groups paid it once per group and layer.
//!
//! A packed form is found by the address of the weight's first number and the view's shape and
//! strides. That address names the same numbers for as long as the weight is frozen: the
//! registry holds the tensor, so its buffer is not freed (and no other buffer can come to lie
//! there), and only tensors that nothing writes are frozen (never a variable, which an optimizer
//! rewrites in place).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use candle_core::Tensor;

use super::operands::Mat;

/// A packed form's key: its type, the address of the view's first number, the view's row and
/// column strides, k and n.
type Key = (TypeId, usize, usize, usize, usize, usize);

struct Registry {
    /// Each frozen tensor's buffer as addresses `[start, end)`, with the tensor itself and the
    /// token of the [`Frozen`] that holds it.
    buffers: Vec<(usize, usize, Tensor, u64)>,
    packed: HashMap<Key, Arc<dyn Any + Send + Sync>>,
    next_token: u64,
}

static REGISTRY: LazyLock<Mutex<Registry>> =
    LazyLock::new(|| Mutex::new(Registry { buffers: Vec::new(), packed: HashMap::new(), next_token: 0 }));

/// How many buffers are frozen: while none is, a product (training's, f32 or bf16) skips the
/// registry's lock.
static FROZEN_BUFFERS: AtomicUsize = AtomicUsize::new(0);

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Tensors declared unchanging by [`freeze`], until this is dropped; their packed forms are
/// dropped with it.
#[derive(Debug)]
pub struct Frozen {
    token: u64,
    count: usize,
}

impl Frozen {
    /// How many tensors it holds.
    pub fn count(&self) -> usize {
        self.count
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let mut r = registry();
        r.buffers.retain(|b| b.3 != self.token);
        FROZEN_BUFFERS.store(r.buffers.len(), Ordering::Relaxed);
        let Registry { buffers, packed, .. } = &mut *r;
        packed.retain(|key, _| buffers.iter().any(|&(s, e, _, _)| s <= key.1 && key.1 < e));
    }
}

/// Declares `tensors` unchanging for as long as the returned [`Frozen`] lives, so that the
/// products that read them pack each once rather than at every call. Only for forward-only
/// commands' models, whose weights nothing writes after loading: a variable is never frozen,
/// nor is anything that is not an f32 tensor on the CPU.
pub fn freeze<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Frozen {
    let mut held = Vec::new();
    for t in tensors {
        if t.is_variable() || !t.device().is_cpu() {
            continue;
        }
        let (storage, _) = t.storage_and_layout();
        if let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage {
            let start = v.as_ptr() as usize;
            held.push((start, start + std::mem::size_of_val(v.as_slice()), t.clone()));
        }
    }
    let mut r = registry();
    let token = r.next_token;
    r.next_token += 1;
    let count = held.len();
    r.buffers.extend(held.into_iter().map(|(s, e, t)| (s, e, t, token)));
    FROZEN_BUFFERS.store(r.buffers.len(), Ordering::Relaxed);
    Frozen { token, count }
}

/// The packed form `make` makes of a product's right operand `w` (`[k, n]`): kept and given
/// again while `w` lies inside a frozen tensor, made for this call alone otherwise.
pub(crate) fn packed<W: Send + Sync + 'static>(w: Mat<f32>, k: usize, n: usize, make: impl FnOnce() -> W) -> Arc<W> {
    if k == 0 || n == 0 || FROZEN_BUFFERS.load(Ordering::Relaxed) == 0 {
        return Arc::new(make());
    }
    let size = std::mem::size_of::<f32>();
    let first = w.data.as_ptr() as usize + w.offset * size;
    let end = first + ((k - 1) * w.row_stride + (n - 1) * w.col_stride + 1) * size;
    let key = (TypeId::of::<W>(), first, w.row_stride, w.col_stride, k, n);
    let inside = |r: &Registry| r.buffers.iter().any(|&(s, e, _, _)| s <= first && end <= e);
    {
        let r = registry();
        if let Some(p) = r.packed.get(&key) {
            if let Ok(p) = p.clone().downcast::<W>() {
                return p;
            }
        }
        if !inside(&r) {
            return Arc::new(make());
        }
    }
    // Made outside the lock: packing runs on the thread pool, whose other tasks may come here
    // too. Two threads packing the same view at once keep the first one stored; a view whose
    // tensor was thawed meanwhile is used for this product and not kept.
    let made = Arc::new(make());
    let mut r = registry();
    if !inside(&r) {
        return made;
    }
    let kept = r.packed.entry(key).or_insert(made.clone()).clone();
    kept.downcast::<W>().unwrap_or(made)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    use candle_core::{Device, Var};

    fn buffer(t: &Tensor) -> (usize, Vec<f32>) {
        let (storage, _) = t.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else { panic!("not f32 on the CPU") };
        (v.as_ptr() as usize, v.clone())
    }

    /// Reads a view of `t`'s own buffer (not a copy) as the kernels would, and says whether
    /// `make` ran.
    fn made(t: &Tensor, offset: usize, k: usize, n: usize, tag: u32) -> (bool, Arc<u32>) {
        let (storage, _) = t.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else { panic!("not f32 on the CPU") };
        let ran = Cell::new(false);
        let p = packed(Mat::transposed(v.as_slice(), offset, k), k, n, || {
            ran.set(true);
            tag
        });
        (ran.get(), p)
    }

    /// A frozen tensor's views are made once and kept, one per view and type; a copy, a view
    /// reaching past the buffer and a variable are made at every call; a dropped `Frozen` takes
    /// its packed forms with it.
    #[test]
    fn frozen_views_are_made_once_and_dropped_with_their_tensors() {
        let (rows, k) = (10, 6);
        let values: Vec<f32> = (0..rows * k).map(|i| i as f32).collect();
        let t = Tensor::from_vec(values.clone(), (rows, k), &Device::Cpu).unwrap();
        let var = Var::from_tensor(&t.copy().unwrap()).unwrap();
        let guard = freeze([&t, var.as_tensor()]);
        assert_eq!(guard.count(), 1, "the variable is not frozen");

        let (ran, first) = made(&t, 0, k, 4, 1);
        assert!(ran);
        let (ran, again) = made(&t, 0, k, 4, 2);
        assert!(!ran && Arc::ptr_eq(&first, &again) && *again == 1, "made again");
        // Another view (channels 3..7, or the last one ending at the buffer's end) is its own.
        assert_eq!(made(&t, 3 * k, k, 4, 3), (true, Arc::new(3)));
        assert_eq!(made(&t, 3 * k, k, 4, 4), (false, Arc::new(3)));
        assert!(made(&t, (rows - 4) * k, k, 4, 5).0);
        assert!(!made(&t, (rows - 4) * k, k, 4, 6).0);
        // One channel further would end past the buffer: not kept (and nothing is read here).
        assert!(made(&t, (rows - 3) * k, k, 4, 7).0 && made(&t, (rows - 3) * k, k, 4, 7).0);
        // Another packed type of the same view has its own entry.
        let ran = Cell::new(0);
        let (storage, _) = t.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) = &*storage else { panic!() };
        for _ in 0..2 {
            let p = packed(Mat::transposed(v.as_slice(), 0, k), k, 4, || {
                ran.set(ran.get() + 1);
                vec![7u16]
            });
            assert_eq!(*p, vec![7u16]);
        }
        assert_eq!(ran.get(), 1);
        drop(storage);

        // Not frozen: a copy of the numbers, the variable.
        let copy = Tensor::from_vec(values, (rows, k), &Device::Cpu).unwrap();
        assert!(made(&copy, 0, k, 4, 8).0 && made(&copy, 0, k, 4, 9).0);
        assert!(made(var.as_tensor(), 0, k, 4, 10).0 && made(var.as_tensor(), 0, k, 4, 11).0);

        let start = buffer(&t).0;
        drop(guard);
        assert!(!registry().packed.keys().any(|key| key.1 >= start && key.1 < start + rows * k * 4), "its packed forms are dropped");
        assert!(made(&t, 0, k, 4, 12).0 && made(&t, 0, k, 4, 13).0, "thawed: made at every call");
    }

    /// The int8 and bf16 products of a frozen weight equal those of the same numbers not frozen,
    /// bit for bit, at the first call and after.
    #[test]
    fn products_of_frozen_weights_equal_products_of_copies() {
        use super::super::operands::Dims;
        let (m, n, k, rows) = (29, 37, 70, 50);
        let rand = |seed, len| -> Vec<f32> {
            crate::util::rng::randn(seed, 0.0, 1.0, &[len], candle_core::DType::F32, &Device::Cpu).unwrap().to_vec1().unwrap()
        };
        let x = rand(900, m * k);
        let values = rand(901, rows * k);
        let t = Tensor::from_vec(values.clone(), (rows, k), &Device::Cpu).unwrap();
        let _guard = freeze([&t]);
        type Product = unsafe fn(*mut f32, usize, usize, Dims, Mat<f32>, Mat<f32>, bool, usize, Option<super::super::operands::Epilogue>);
        let mut kernels: Vec<(&str, Product)> = Vec::new();
        if super::super::int8_gemm::available() {
            kernels.push(("int8", super::super::int8_gemm::product));
        }
        if super::super::bf16_gemm::available() {
            kernels.push(("bf16", super::super::bf16_gemm::product));
        }
        let (storage, _) = t.storage_and_layout();
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(held)) = &*storage else { panic!() };
        for (name, product) in kernels {
            let run = |w: Mat<f32>| {
                let mut y = vec![0f32; m * n];
                // SAFETY: the kernel's instructions are there (checked above); y holds m×n.
                unsafe { product(y.as_mut_ptr(), 0, n, Dims { m, n, k }, Mat::rows(&x, 0, k), w, false, 2, None) };
                y
            };
            for first in [0, 9] {
                let copy = values[first * k..(first + n) * k].to_vec();
                let want = run(Mat::transposed(&copy, 0, k));
                for call in 0..2 {
                    assert_eq!(run(Mat::transposed(held.as_slice(), first * k, k)), want, "{name}: channels from {first}, call {call}");
                }
            }
        }
    }
}
