//! An exponential moving average of the weights (`train.ema_decay`), as timm's `ModelEmaV3`
//! keeps one: every floating-point tensor of the model, parameters and BatchNorm statistics alike,
//! moved towards the weights after each optimiser step, with the decay ramped up from 0.
//!
//! The average is kept in f32 (f64 for an f64 model) beside the weights, on their device, by
//! rank 0 only: every rank holds the same weights, and rank 0 alone evaluates and saves.

use std::collections::HashMap;

use candle_core::{DType, Result, Tensor};
use candle_nn::VarMap;

/// How the decay grows with the number of updates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmaSchedule {
    /// The decay once warmed up.
    pub decay: f64,
    pub warmup: bool,
    pub gamma: f64,
    pub power: f64,
}

impl EmaSchedule {
    /// The run's schedule, or none when `train.ema_decay` is 0.
    pub fn from_config(t: &crate::config::TrainConfig) -> Option<EmaSchedule> {
        (t.ema_decay > 0.0).then_some(EmaSchedule {
            decay: t.ema_decay,
            warmup: t.ema_warmup,
            gamma: t.ema_warmup_gamma,
            power: t.ema_warmup_power,
        })
    }

    /// The decay of update number `n` (1 for the first): 0 for the first, which copies the
    /// weights; then `1 − (1 + (n−1)/γ)^−p` capped at the decay with warm-up, the decay without.
    /// timm's `get_decay(step)` with `update_after_step = 0` and `min_decay = 0`.
    pub fn decay_at(&self, n: u64) -> f64 {
        let since_first = n.saturating_sub(1);
        if since_first == 0 {
            return 0.0;
        }
        if !self.warmup {
            return self.decay;
        }
        (1.0 - (1.0 + since_first as f64 / self.gamma).powf(-self.power)).clamp(0.0, self.decay)
    }
}

/// The average itself: one tensor per model variable, by the variable's name.
pub struct WeightEma {
    pub schedule: EmaSchedule,
    average: HashMap<String, Tensor>,
}

/// The dtype the average of a `dtype` variable is kept in.
fn average_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl WeightEma {
    /// An average starting at the current weights.
    pub fn new(vars: &VarMap, schedule: EmaSchedule) -> Result<WeightEma> {
        let data = vars.data().lock().unwrap();
        let average = data
            .iter()
            .map(|(name, v)| Ok((name.clone(), v.as_tensor().detach().to_dtype(average_dtype(v.dtype()))?.copy()?)))
            .collect::<Result<_>>()?;
        Ok(WeightEma { schedule, average })
    }

    /// Moves the average towards the weights after optimiser step `n` (the first is 1):
    /// `a ← d·a + (1 − d)·w`.
    pub fn update(&mut self, vars: &VarMap, n: u64) -> Result<()> {
        let d = self.schedule.decay_at(n);
        let data = vars.data().lock().unwrap();
        for (name, avg) in self.average.iter_mut() {
            let w = data.get(name).ok_or_else(|| candle_core::Error::Msg(format!("the weight average has {name}, the model does not")))?;
            // Detached: arithmetic on a variable records a graph, which would chain every
            // average to all the weights before it.
            let w = w.as_tensor().detach().to_dtype(avg.dtype())?;
            *avg = ((&*avg * d)? + (w * (1.0 - d))?)?.detach();
        }
        Ok(())
    }

    /// The average by variable name, for a checkpoint.
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        self.average.clone()
    }

    /// Replaces the average with a saved one, which must hold exactly the model's variables.
    pub fn restore(&mut self, saved: &HashMap<String, Tensor>, origin: &std::path::Path) -> anyhow::Result<()> {
        let mut missing: Vec<&String> = self.average.keys().filter(|k| !saved.contains_key(*k)).collect();
        let mut unexpected: Vec<&String> = saved.keys().filter(|k| !self.average.contains_key(*k)).collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            missing.sort();
            unexpected.sort();
            anyhow::bail!("{} does not match the model: missing {missing:?}; unexpected {unexpected:?}", origin.display());
        }
        for (name, avg) in self.average.iter_mut() {
            let t = &saved[name];
            if t.dims() != avg.dims() {
                anyhow::bail!("{}: {name} has shape {:?}, the model {:?}", origin.display(), t.dims(), avg.dims());
            }
            *avg = t.to_dtype(avg.dtype())?.to_device(avg.device())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn schedule(decay: f64, warmup: bool) -> EmaSchedule {
        EmaSchedule { decay, warmup, gamma: 1.0, power: 2.0 / 3.0 }
    }

    #[test]
    fn decay_ramps_up_as_timm_computes_it() {
        let s = schedule(0.9999, true);
        assert_eq!(s.decay_at(1), 0.0);
        // 1 − 2^(−2/3), 1 − 3^(−2/3), 1 − 10^(−2/3), by hand.
        for (n, want) in [(2, 0.370_039_475_8), (3, 0.519_250_143_2), (10, 0.784_556_531_0)] {
            assert!((s.decay_at(n) - want).abs() < 1e-9, "update {n}: {}", s.decay_at(n));
        }
        // Capped once the ramp passes the decay: 1 − (1 + n)^(−2/3) > 0.9999 from n = 10^6.
        assert_eq!(s.decay_at(2_000_001), 0.9999);
        let flat = schedule(0.99, false);
        assert_eq!((flat.decay_at(1), flat.decay_at(2), flat.decay_at(500)), (0.0, 0.99, 0.99));
        let slow = EmaSchedule { gamma: 4.0, power: 0.75, ..s };
        assert!((slow.decay_at(5) - (1.0 - 2f64.powf(-0.75))).abs() < 1e-12);
    }

    /// Several steps of changing f32 weights: the f32 average follows the f64 recurrence
    /// computed here from the same weights.
    #[test]
    fn average_matches_an_f64_reference_over_several_steps() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        vm.get((3, 4), "w", candle_nn::Init::Const(0.0), DType::F32, &dev).unwrap();
        vm.get(5, "b", candle_nn::Init::Const(0.0), DType::F32, &dev).unwrap();
        let var = |name: &str| vm.data().lock().unwrap()[name].clone();
        let (w, b) = (var("w"), var("b"));
        let mut rng = crate::util::rng::Rng::new(3);
        let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
        w.set(&Tensor::from_vec(draw(12), (3, 4), &dev).unwrap()).unwrap();
        b.set(&Tensor::from_vec(draw(5), 5, &dev).unwrap()).unwrap();
        let s = schedule(0.9, true);
        let mut ema = WeightEma::new(&vm, s).unwrap();
        let read = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap() };
        let mut want_w: Vec<f64> = read(&w);
        let mut want_b: Vec<f64> = read(&b);
        for n in 1..=30u64 {
            // The optimiser's step, then the update, as the step loop does.
            let (dw, db) = (draw(12), draw(5));
            w.set(&(w.as_tensor() + Tensor::from_vec(dw, (3, 4), &dev).unwrap()).unwrap()).unwrap();
            b.set(&(b.as_tensor() + Tensor::from_vec(db, 5, &dev).unwrap()).unwrap()).unwrap();
            ema.update(&vm, n).unwrap();
            let d = if n == 1 { 0.0 } else { (1.0 - (n as f64).powf(-2.0 / 3.0)).min(0.9) };
            for (a, x) in want_w.iter_mut().zip(read(&w)) {
                *a = d * *a + (1.0 - d) * x;
            }
            for (a, x) in want_b.iter_mut().zip(read(&b)) {
                *a = d * *a + (1.0 - d) * x;
            }
            let got = ema.tensors();
            for (name, want) in [("w", &want_w), ("b", &want_b)] {
                for (g, r) in read(&got[name]).iter().zip(want) {
                    assert!((g - r).abs() <= 1e-6 * (1.0 + r.abs()), "update {n}, {name}: {g} vs {r}");
                }
            }
            if n == 1 {
                assert_eq!(read(&got["w"]), read(&w), "the first update copies the weights");
            }
            // A recorded graph would keep every earlier average alive (memory growing per step).
            assert!(got.values().all(|t| !t.track_op()), "update {n}: the average records a graph");
        }
    }

    #[test]
    fn restoring_needs_the_same_variables() {
        let dev = Device::Cpu;
        let vm = VarMap::new();
        vm.get(2, "a", candle_nn::Init::Const(1.0), DType::F32, &dev).unwrap();
        let mut ema = WeightEma::new(&vm, schedule(0.9, true)).unwrap();
        let mut saved = HashMap::new();
        saved.insert("a".to_string(), Tensor::new(&[5f32, 6.0], &dev).unwrap());
        ema.restore(&saved, std::path::Path::new("ema.safetensors")).unwrap();
        assert_eq!(ema.tensors()["a"].to_vec1::<f32>().unwrap(), [5.0, 6.0]);
        saved.insert("z".to_string(), Tensor::new(&[1f32], &dev).unwrap());
        let e = ema.restore(&saved, std::path::Path::new("ema.safetensors")).unwrap_err().to_string();
        assert!(e.contains("ema.safetensors") && e.contains("unexpected [\"z\"]"), "{e}");
    }
}
