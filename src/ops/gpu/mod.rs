//! The GPU side of the ops: one launch path for every `.cu` file under `kernels/`. Which kernels
//! an op launches, in what order, on which buffers and with what grid is a [`Program`] of plain
//! data, planned per kernel file (`rows`, `channels`, `depthwise`, `optim`); [`Module`] is the
//! registry of those files and their PTX.
//!
//! A program is run by one of two executors: cudarc's on a GPU (`cuda`, with `--features
//! cuda`), and in the tests a host emulation that compiles the same `.cu` sources as C++
//! (`kernels/host/`, driven by `host`) and runs each launch with real threads meeting at
//! `__syncthreads`. So the kernels, their launch geometry and their argument wiring are all
//! checked against the CPU ops on machines without a GPU; only cudarc's copying of arguments is
//! not. Every kernel takes the same arguments: `(a, b, c, side, out, params)`.

// Without the `cuda` feature, only the tests run programs (on the host emulation).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

pub(crate) mod channels;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub(crate) mod depthwise;
#[cfg(test)]
pub(crate) mod host;
pub(crate) mod optim;
pub(crate) mod program;
pub(crate) mod rows;

#[cfg(test)]
pub(crate) use program::SMALL_GRID;
#[cfg(test)]
use program::{Dst, Src};
pub(crate) use program::{Limits, Program, SideBuf};

/// Runs `program` on the host on `operands`, every output and scratch element starting as NaN
/// (so one the launches miss shows in the result); [`run_on_host_in_place`] starts from `out`.
#[cfg(test)]
pub(crate) fn run_on_host<T: super::Float + host::Pod>(program: &Program, operands: &[&[T]], side: Option<&SideBuf>) -> Vec<T> {
    let mut out = vec![T::from(f64::NAN); program.out_len];
    run_on_host_in_place(program, &mut out, operands, side);
    out
}

#[cfg(test)]
pub(crate) fn run_on_host_in_place<T: super::Float + host::Pod>(
    program: &Program,
    out: &mut [T],
    operands: &[&[T]],
    side: Option<&SideBuf>,
) {
    assert_eq!(out.len(), program.out_len, "the program's output length");
    let nan = T::from(f64::NAN);
    let mut scratch: Vec<Vec<T>> = program.scratch.iter().map(|&n| vec![nan; n]).collect();
    for l in &program.launches {
        let inputs: Vec<Option<Vec<T>>> = l
            .inputs
            .iter()
            .map(|src| match *src {
                Src::Operand(i) => Some(operands[i].to_vec()),
                Src::Scratch(k) => Some(scratch[k].clone()),
                Src::Null => None,
            })
            .collect();
        let inputs: Vec<Option<&[T]>> = inputs.iter().map(|v| v.as_deref()).collect();
        let region: &mut [T] = match l.out {
            Dst::Out { offset, len } => &mut out[offset..offset + len],
            Dst::Scratch(k) => &mut scratch[k],
        };
        let side = match (l.side, side) {
            (true, Some(b)) => Some(b),
            (true, None) => panic!("{} needs its side buffer", l.kernel),
            (false, _) => None,
        };
        host::launch(l.kernel, (l.grid, l.block, l.shared_bytes), host::param_bytes(&l.params), &inputs, side, region);
    }
}

#[cfg(test)]
mod tests {
    use super::host::values;
    use super::program::{Module, Params, GPU};
    use super::rows::row_threads;
    use super::*;

    #[test]
    fn launches_that_miss_elements_are_caught_as_nan() {
        // Two column-sum launches whose second writes only half the output: the host executor
        // starts every buffer as NaN, so the unwritten half shows.
        let mut program = Program::column_sums(40, 6, &SMALL_GRID);
        let last = program.launches.last_mut().unwrap();
        last.out = Dst::Out { offset: 0, len: 3 };
        let Params::Row(p) = &mut last.params else { unreachable!("column sums are a row kernel") };
        p.cols = 3;
        let x = values(1, 0.0, 1.0, 240);
        let out = run_on_host(&program, &[&x], None);
        assert!(out[..3].iter().all(|v| v.is_finite()) && out[3..].iter().all(|v| v.is_nan()), "{out:?}");
    }

    #[test]
    fn row_blocks_are_powers_of_two_from_a_warp_to_the_cap() {
        assert_eq!([1, 32, 33, 48, 197, 256, 3000].map(row_threads), [32, 32, 64, 64, 256, 256, 256]);
    }

    #[test]
    fn layer_norm_backward_refuses_rows_that_overflow_shared_memory() {
        let err = Program::layer_norm_grad(4, 6000, 1e-5, 8, &GPU).unwrap_err().to_string();
        assert!(err.contains("shared memory"), "{err}");
    }

    #[test]
    fn build_rs_compiles_every_registered_kernel_file() {
        let build = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/build.rs")).unwrap();
        let list = build.lines().find(|l| l.starts_with("const KERNELS")).expect("build.rs lists its kernel files");
        for m in Module::ALL {
            assert!(list.contains(&format!("\"{}\"", m.file())), "build.rs does not compile kernels/{}.cu: {list}", m.file());
            assert!(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("kernels/{}.cu", m.file())).is_file());
        }
        assert_eq!(list.matches('"').count(), 2 * Module::ALL.len(), "build.rs compiles a file the registry lacks: {list}");
    }
}
