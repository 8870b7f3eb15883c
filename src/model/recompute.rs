//! Activation checkpointing (`train.grad_checkpointing`): a segment of a tower (a transformer
//! block, an MBConv block) runs forward without keeping its graph, and the backward pass runs it
//! again with a graph and back-propagates through that recomputation. Only the segments' inputs
//! stay alive between forward and backward, for about one more forward pass of compute.
//!
//! candle has no backward hooks, so the segment is a custom op whose backward does the
//! recomputation. A custom op can only return the gradient of its input; the gradients of the
//! segment's own parameters go to a [`GradSink`] that the training step drains after each
//! backward pass and adds to the rest.

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, Var};

/// Parameter gradients of recomputed segments, one store per segment and backward pass.
#[derive(Default)]
pub struct GradSink(Mutex<Vec<GradStore>>);

impl GradSink {
    fn push(&self, g: GradStore) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(g);
    }

    pub fn take(&self) -> Vec<GradStore> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A segment's forward; the flag is true when it runs again inside the backward pass (BatchNorm
/// must then leave its running statistics alone; stochastic depth draws the same masks because
/// they come from the step's seed).
pub type Segment = Arc<dyn Fn(&Tensor, bool) -> Result<Tensor> + Send + Sync>;

/// `store` with every gradient cut from the graph that computed it. candle leaves the gradients
/// of leaves (parameters) attached: a weight's gradient `xᵀ·dy` keeps its input `x`, and through it
/// the whole forward graph, alive for as long as the gradient lives.
pub fn detached(mut store: GradStore) -> GradStore {
    let ids: Vec<_> = store.get_ids().copied().collect();
    for id in ids {
        if let Some(g) = store.get_id(id).map(Tensor::detach) {
            store.insert_id(id, g);
        }
    }
    store
}

/// Whether segments are checkpointed, and where their parameter gradients go.
#[derive(Clone, Default)]
pub struct Checkpointing(Option<Arc<GradSink>>);

impl Checkpointing {
    pub fn on(sink: Arc<GradSink>) -> Self {
        Checkpointing(Some(sink))
    }

    /// `segment(x)`, checkpointed when on and when `x` is part of a graph (a segment whose input
    /// needs no gradient would otherwise never be reached by the backward pass, and neither would
    /// its parameters).
    pub fn run(&self, x: &Tensor, segment: Segment) -> Result<Tensor> {
        match &self.0 {
            Some(sink) if x.track_op() => {
                let y = segment(&x.detach(), false)?.detach();
                // The op's forward copies this tensor out as its own output: on the CPU its
                // contiguous range, on CUDA its whole storage, which must then be a fresh copy.
                let y = if y.device().is_cpu() { y.contiguous()? } else { y.copy()? };
                x.apply_op1(Recompute { segment, out: Mutex::new(Some(y)), sink: sink.clone() })
            }
            _ => segment(x, false),
        }
    }
}

struct Recompute {
    segment: Segment,
    /// The forward result computed without a graph, taken by the op's forward.
    out: Mutex<Option<Tensor>>,
    sink: Arc<GradSink>,
}

impl Recompute {
    fn take(&self) -> Result<Tensor> {
        match self.out.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(t) => Ok(t),
            None => candle_core::bail!("checkpointed segment evaluated twice"),
        }
    }
}

fn copy_cpu(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("checkpointed output must be contiguous") };
    Ok(match s {
        CpuStorage::F32(d) => CpuStorage::F32(d[a..b].to_vec()),
        CpuStorage::F64(d) => CpuStorage::F64(d[a..b].to_vec()),
        CpuStorage::BF16(d) => CpuStorage::BF16(d[a..b].to_vec()),
        CpuStorage::F16(d) => CpuStorage::F16(d[a..b].to_vec()),
        other => candle_core::bail!("checkpointing supports float tensors, got {:?}", candle_core::backend::BackendStorage::dtype(other)),
    })
}

impl CustomOp1 for Recompute {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((copy_cpu(s, layout)?, y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment changed device"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _s: &candle_core::CudaStorage, _l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            // `run` made `y` a fresh copy: its storage is exactly its elements.
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment changed device"),
        }
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _profile = crate::util::profile::region("recompute");
        let x = Var::from_tensor(&x.detach())?;
        let y = (self.segment)(x.as_tensor(), true)?;
        // Σ y·dy has dy as its gradient with respect to y: back-propagating it through the
        // recomputed graph is the segment's vector-Jacobian product. Summed in f32 at least.
        let wide = |t: &Tensor| if matches!(t.dtype(), DType::BF16 | DType::F16) { t.to_dtype(DType::F32) } else { Ok(t.clone()) };
        let pull = grad.detach();
        let surrogate = (wide(&y)? * wide(&pull)?)?.sum_all()?;
        let mut grads = detached(surrogate.backward()?);
        grads.remove(&pull);
        let dx = grads.remove(x.as_tensor());
        self.sink.push(grads);
        Ok(dx)
    }
}
