//! The element types the CPU kernels run in.

use super::fast_math;

/// f32 or f64. Per-element arithmetic runs in the storage's own precision (f32 math is about
/// twice as fast and vectorises twice as wide); constants are prepared in f64. `erf` is
/// `fast_math`'s in f32 (libm's scalar `erff` was 3.5% of a ViT-Ti step) and libm's in f64, the
/// precision the gradient checks run in; `exp` likewise (libm's `expf` is a scalar call, which
/// keeps SiLU and softmax loops from vectorising: with `fast_math::exp` and [`simd`], a B0
/// step's BatchNorm backward went from 273 to 147 ms).
pub trait Float:
    candle_core::WithDType
    + Copy
    + PartialOrd
    + Send
    + Sync
    + Default
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    fn f(self) -> f64;
    fn from(v: f64) -> Self;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn erf(self) -> Self;
    /// `(erf(x), e^(−x²))`.
    fn erf_and_gauss(self) -> (Self, Self);
}

impl Float for f32 {
    fn f(self) -> f64 {
        self as f64
    }
    fn from(v: f64) -> Self {
        v as f32
    }
    fn exp(self) -> Self {
        fast_math::exp(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn erf(self) -> Self {
        fast_math::erf(self)
    }
    fn erf_and_gauss(self) -> (Self, Self) {
        fast_math::erf_and_gauss(self)
    }
}

impl Float for f64 {
    fn f(self) -> f64 {
        self
    }
    fn from(v: f64) -> Self {
        v
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn erf(self) -> Self {
        candle_core::cpu::erf::erf_f64(self)
    }
    fn erf_and_gauss(self) -> (Self, Self) {
        (Float::erf(self), (-self * self).exp())
    }
}
