//! `exp` and `erf` for f32 written with only multiplies, adds, one division and bit operations,
//! so loops over slices vectorise. libm's scalar `erff` was 3.5% of a ViT-Ti training step
//! through GELU and its derivative (perf). Both are within a few f32 ulps (tests below), far
//! inside what a network computing in f32 (or bf16) can tell apart.

/// ln 2 split so that n·LN2_HI is exact for every exponent n (LN2_HI = 355/512 has 9 bits).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5·2²³: adding and subtracting it rounds an f32 of magnitude below 2²² to an integer.
const ROUNDER: f32 = 12_582_912.0;

/// eˣ for f32: x = n·ln 2 + r with |r| ≤ ln2/2, eʳ by its degree-6 Taylor polynomial (truncation
/// below 1.3e-7 relative), 2ⁿ put into the exponent bits. Results below f32's normal range are
/// 0 (a softmax's masked entries must be exactly 0), above it saturate at e⁸⁸.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let underflow = x < -87.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `shifted`'s low mantissa bits hold n + 2²², and shifting n + 127 into the exponent pushes
    // the rest out: 2ⁿ with integer operations only (`n as i32` is a saturating conversion,
    // compares and blends more per vector).
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    if underflow {
        0.0
    } else {
        p * scale
    }
}

/// erf for f32 by Abramowitz & Stegun 7.1.26 (1.5e-7 in exact arithmetic, below 5e-7 in f32):
/// erf(|x|) = 1 − t·(a₁ + t·(a₂ + …))·e^(−x²), t = 1/(1 + p·|x|), sign restored.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    erf_and_gauss(x).0
}

/// `(erf(x), e^(−x²))`: erf's formula computes the Gaussian factor anyway, and GELU's derivative
/// needs both (its exp was a third of the GELU backward's time when computed twice).
#[inline(always)]
pub fn erf_and_gauss(x: f32) -> (f32, f32) {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152 + t * 1.061_405_4))));
    let gauss = exp(-a * a);
    ((1.0 - poly * gauss).copysign(x), gauss)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulps_of_the_exact_value() {
        let mut worst = 0.0f64;
        for i in -86_900..=87_900 {
            let x = i as f32 * 1e-3;
            let exact = (x as f64).exp();
            worst = worst.max(((exp(x) as f64) - exact).abs() / exact);
        }
        // f32's unit roundoff is 6e-8.
        assert!(worst < 4e-7, "largest relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1e9), 0.0);
    }

    /// 2ⁿ from `shifted`'s bits is 2ⁿ from n converted to an integer, on a grid over the clamped
    /// range (every n from −126 to 127).
    #[test]
    fn the_power_of_two_from_the_rounder_bits_is_the_integer_ones() {
        for i in -87_000..=88_000 {
            for x in [i as f32 * 1e-3, (i as f32 * 1e-3).next_up()] {
                let x = x.clamp(-87.0, 88.0);
                let shifted = x * std::f32::consts::LOG2_E + ROUNDER;
                let n = shifted - ROUNDER;
                let from_int = f32::from_bits(((n as i32 + 127) as u32) << 23);
                assert_eq!(f32::from_bits(shifted.to_bits().wrapping_add(127) << 23), from_int, "x = {x}");
            }
        }
    }

    #[test]
    fn erf_is_within_5e_7_of_the_exact_value() {
        let mut worst = 0.0f64;
        for i in -6000..=6000 {
            let x = i as f32 * 1e-3;
            let exact = candle_core::cpu::erf::erf_f64(x as f64);
            worst = worst.max(((erf(x) as f64) - exact).abs());
            let (e, gauss) = erf_and_gauss(x);
            assert_eq!(e, erf(x));
            // Against the exact exponential of the f32 argument: rounding −x² to f32 alone moves
            // e^(−x²) by up to x²·6e-8 relative, as in any f32 evaluation.
            let exact_gauss = ((-x * x) as f64).exp();
            assert!((gauss as f64 - exact_gauss).abs() <= 4e-7 * exact_gauss + 1e-30, "e^-x² at {x}: {gauss}");
        }
        // The approximation's own 1.5e-7 plus f32 rounding of 1 − poly·e^(−x²).
        assert!(worst < 5e-7, "largest absolute error {worst}");
        assert!(erf(0.0).abs() < 1e-7);
        assert_eq!(erf(-9.0), -1.0);
    }
}
