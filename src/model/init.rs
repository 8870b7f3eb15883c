//! Seeded parameter creation.
//!
//! candle's CPU device cannot be seeded, so a `VarMap` initialises weights differently on every
//! run. This backend creates each variable from our own generator seeded by the run seed and the
//! variable's name: the same config and seed give the same initial weights, in any construction
//! order and on any device.

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::init::{FanInOut, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

use crate::util::rng::{hash_str, Rng};

pub struct SeededVars {
    map: VarMap,
    seed: u64,
}

impl SeededVars {
    pub fn builder(map: &VarMap, seed: u64, device: &Device) -> VarBuilder<'static> {
        Self::builder_dtype(map, seed, DType::F32, device)
    }

    /// As `builder`, with variables of another dtype (f64 for gradient checks).
    pub fn builder_dtype(map: &VarMap, seed: u64, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(SeededVars { map: map.clone(), seed }), dtype, device.clone())
    }
}

/// Samples an initial value on the host. Truncation for `Randn` follows the common practice for
/// transformers (BERT, ViT): values beyond two standard deviations are redrawn.
pub fn sample_init(shape: &Shape, init: Init, rng: &mut Rng) -> Vec<f32> {
    let n = shape.elem_count();
    match init {
        Init::Const(v) => vec![v as f32; n],
        Init::Randn { mean, stdev } => (0..n)
            .map(|_| loop {
                let z = rng.normal();
                if z.abs() <= 2.0 {
                    break (mean + stdev * z) as f32;
                }
            })
            .collect(),
        Init::Uniform { lo, up } => (0..n).map(|_| rng.uniform(lo, up) as f32).collect(),
        Init::Kaiming { dist, fan, non_linearity } => {
            let fan_n = fan.for_shape(shape).max(1) as f64;
            let std = non_linearity.gain() / fan_n.sqrt();
            match dist {
                NormalOrUniform::Normal => (0..n).map(|_| (std * rng.normal()) as f32).collect(),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    (0..n).map(|_| rng.uniform(-bound, bound) as f32).collect()
                }
            }
        }
    }
}

impl SimpleBackend for SeededVars {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let mut data = self.map.data().lock().unwrap();
        if let Some(v) = data.get(name) {
            if v.shape() != &s {
                candle_core::bail!("variable {name} exists with shape {:?}, requested {:?}", v.shape(), s);
            }
            // BatchNorm's running averages stay as they are: the layer updates them in place,
            // which a cast copy (a bf16 compute view) would silently drop.
            if crate::model::batch_norm::is_running_stat(name) {
                return Ok(v.as_tensor().clone());
            }
            return v.as_tensor().to_dtype(dtype);
        }
        let mut rng = Rng::derived(self.seed, &[hash_str(name)]);
        let values = sample_init(&s, h, &mut rng);
        let t = Tensor::from_vec(values, s, dev)?.to_dtype(dtype)?;
        let var = Var::from_tensor(&t)?;
        let out = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(out)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("variable {name} must be created with a shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.map.data().lock().unwrap().contains_key(name)
    }
}

/// A builder whose parameters are the given tensors, used as they are: not variables, so a
/// forward pass through a model built on them records no graph and keeps no activation past its
/// use (evaluation, embedding, scoring). A name the map lacks, or holds at another shape, is an
/// error naming it.
pub struct FixedVars {
    tensors: std::collections::HashMap<String, Tensor>,
}

impl FixedVars {
    pub fn builder(tensors: std::collections::HashMap<String, Tensor>, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(FixedVars { tensors }), dtype, device.clone())
    }
}

impl SimpleBackend for FixedVars {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| candle_core::Error::Msg(format!("no weight {name}")))?;
        if t.shape() != &s {
            candle_core::bail!("weight {name} has shape {:?}, the model needs {:?}", t.dims(), s.dims());
        }
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.tensors.get(name).ok_or_else(|| candle_core::Error::Msg(format!("no weight {name}")))?.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// A builder that allocates nothing: every parameter is a zero broadcast to its shape, and the
/// names and shapes asked for are recorded. Building a model on it lists the parameters the
/// model would have, so that sizes read from a file can be checked against the weights before
/// anything of that size exists.
#[derive(Clone, Default)]
pub struct ShapeVars {
    shapes: std::sync::Arc<std::sync::Mutex<Shapes>>,
}

/// Parameter names and shapes, in the order a model asks for them.
type Shapes = Vec<(String, Vec<usize>)>;

impl ShapeVars {
    pub fn builder(&self) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), DType::F32, Device::Cpu)
    }

    /// The parameters asked for so far, by name.
    pub fn shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.shapes.lock().unwrap().clone()
    }
}

impl SimpleBackend for ShapeVars {
    fn get(&self, s: Shape, name: &str, _h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        self.shapes.lock().unwrap().push((name.to_string(), s.dims().to_vec()));
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("variable {name} must be created with a shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.shapes.lock().unwrap().iter().any(|(n, _)| n == name)
    }
}

/// Kaiming-uniform as PyTorch's default for `nn.Linear` weights.
pub const LINEAR_DEFAULT: Init = Init::Kaiming {
    dist: NormalOrUniform::Uniform,
    fan: FanInOut::FanIn,
    non_linearity: candle_nn::init::NonLinearity::ExplicitGain(0.577_350_269_189_625_8),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_and_name_give_the_same_weights_in_any_order() {
        let dev = Device::Cpu;
        let (m1, m2) = (VarMap::new(), VarMap::new());
        let vb1 = SeededVars::builder(&m1, 7, &dev);
        let vb2 = SeededVars::builder(&m2, 7, &dev);
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let a1 = vb1.get_with_hints((4, 3), "a", init).unwrap();
        let b1 = vb1.get_with_hints((5,), "b", init).unwrap();
        let b2 = vb2.get_with_hints((5,), "b", init).unwrap();
        let a2 = vb2.get_with_hints((4, 3), "a", init).unwrap();
        assert_eq!(a1.to_vec2::<f32>().unwrap(), a2.to_vec2::<f32>().unwrap());
        assert_eq!(b1.to_vec1::<f32>().unwrap(), b2.to_vec1::<f32>().unwrap());
        let other = SeededVars::builder(&VarMap::new(), 8, &dev).get_with_hints((5,), "b", init).unwrap();
        assert_ne!(b1.to_vec1::<f32>().unwrap(), other.to_vec1::<f32>().unwrap());
        // Requests for an existing name return the same variable.
        assert_eq!(m1.all_vars().len(), 2);
    }

    #[test]
    fn truncated_normal_stays_within_two_sigma() {
        let v = sample_init(&Shape::from((10_000,)), Init::Randn { mean: 0.0, stdev: 0.02 }, &mut Rng::new(1));
        assert!(v.iter().all(|x| x.abs() <= 0.04 + 1e-7));
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        // A normal truncated at 2 sigma has std 0.88 sigma.
        assert!((std - 0.0176).abs() < 0.0008, "{std}");
    }
}
