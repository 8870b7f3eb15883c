//! Runs align's CUDA kernels on the host for the tests: each launch goes to
//! `kernels/host/driver.cpp`, which compiles the `.cu` sources as C++ with an emulation of the
//! CUDA thread model (`kernels/host/emulate.h`), built once with the machine's C++ compiler
//! (`CXX`, else `c++`). The ops' tests run their GPU launch plans through it against their CPU
//! kernels.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::super::Float;
use super::program::{kernel_suffix, Module, Params, SideBuf};

/// The compiled driver, shared by test processes (nextest runs one per test) under a name
/// derived from its sources and the compiler, so that an edit to a kernel rebuilds it.
fn driver() -> &'static Path {
    static DRIVER: OnceLock<PathBuf> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        cxx.hash(&mut hasher);
        let kernel_files = Module::ALL.map(|m| format!("{}.cu", m.file()));
        for source in ["host/driver.cpp", "host/emulate.h", "reduce.cuh"].into_iter().chain(kernel_files.iter().map(String::as_str)) {
            std::fs::read(root.join(source)).expect("kernel source").hash(&mut hasher);
        }
        let dir = std::env::temp_dir().join("align-kernel-host");
        std::fs::create_dir_all(&dir).expect("temp dir");
        let exe = dir.join(format!("driver-{:016x}", hasher.finish()));
        if exe.is_file() {
            return exe;
        }
        // Built under a name of this process's, then renamed: concurrent test processes
        // never run a half-written binary.
        let partial = dir.join(format!("driver-building-{}", std::process::id()));
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&partial)
            .arg(root.join("host/driver.cpp"))
            .output()
            .unwrap_or_else(|e| panic!("the kernel tests need a C++20 compiler ({cxx}: {e})"));
        assert!(out.status.success(), "compiling the kernel host driver failed:\n{}", String::from_utf8_lossy(&out.stderr));
        std::fs::rename(&partial, &exe).expect("install the driver");
        exe
    })
}

fn array<T: Pod>(buf: &mut Vec<u8>, v: &[T]) {
    buf.extend_from_slice(&(v.len() as u64).to_ne_bytes());
    buf.extend_from_slice(bytes(v));
}

/// f32 and f64: types without padding or invalid bit patterns.
pub trait Pod: Copy {}
impl Pod for f32 {}
impl Pod for f64 {}

fn bytes<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: T is plain data (Pod), so every byte is initialised.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn from_bytes<T: Pod + Default>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::default(); b.len() / std::mem::size_of::<T>()];
    // SAFETY: v has room for b's bytes and T accepts any bit pattern.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), v.len() * std::mem::size_of::<T>()) };
    v
}

/// A launch's parameter struct as bytes.
pub fn param_bytes(p: &Params) -> &[u8] {
    match p {
        Params::Row(p) => struct_bytes(p),
        Params::Channel(p) => struct_bytes(p),
        Params::Depthwise(p) => struct_bytes(p),
        Params::Optim(p) => struct_bytes(p),
    }
}

fn struct_bytes<P: Copy>(p: &P) -> &[u8] {
    // SAFETY: the four parameter structs (`RowParams`, `ChannelParams`, `DepthwiseParams`,
    // `OptimParams`) are #[repr(C)]
    // of plain numbers without padding, so every byte is initialised.
    unsafe { std::slice::from_raw_parts((p as *const P).cast(), std::mem::size_of::<P>()) }
}

/// One launch of kernel `name` (without its dtype suffix) in the driver: `operands` in
/// order (`None`: a null pointer), `out` holding the output's initial contents and, after,
/// what the kernel left there.
pub fn launch<T: Float + Pod>(
    name: &str,
    (grid, block, shared_bytes): (u32, u32, u32),
    params: &[u8],
    operands: &[Option<&[T]>],
    side: Option<&SideBuf>,
    out: &mut [T],
) {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let id = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("{name}_{}", kernel_suffix::<T>());
    let mut req = Vec::new();
    req.extend_from_slice(&(name.len() as u32).to_ne_bytes());
    req.extend_from_slice(name.as_bytes());
    for v in [grid, block, shared_bytes, std::mem::size_of::<T>() as u32, params.len() as u32] {
        req.extend_from_slice(&v.to_ne_bytes());
    }
    req.extend_from_slice(params);
    req.extend_from_slice(&(operands.len() as u32).to_ne_bytes());
    for op in operands {
        array(&mut req, op.unwrap_or(&[]));
    }
    let side = match side {
        Some(SideBuf::F32(v)) => bytes(v),
        Some(SideBuf::F64(v)) => bytes(v),
        None => &[],
    };
    req.extend_from_slice(&(side.len() as u64).to_ne_bytes());
    req.extend_from_slice(side);
    array(&mut req, out);
    let dir = driver().parent().expect("driver dir");
    let pid = std::process::id();
    let (req_path, out_path) = (dir.join(format!("req-{pid}-{id}")), dir.join(format!("out-{pid}-{id}")));
    std::fs::File::create(&req_path).and_then(|mut f| f.write_all(&req)).expect("write request");
    let status = Command::new(driver()).arg(&req_path).arg(&out_path).status().expect("run the kernel driver");
    assert!(status.success(), "{name} failed in the host emulation");
    let bytes = std::fs::read(&out_path).expect("read output");
    out.copy_from_slice(&from_bytes::<T>(&bytes));
    let _ = std::fs::remove_file(req_path);
    let _ = std::fs::remove_file(out_path);
}

/// `n` normal values from `seed`, in f64.
pub fn values(seed: u64, mean: f64, std: f64, n: usize) -> Vec<f64> {
    let t = crate::util::rng::randn(seed, mean, std, n, candle_core::DType::F64, &candle_core::Device::Cpu).unwrap();
    t.to_vec1::<f64>().unwrap()
}

pub fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Panics unless `got` matches `want` within `tol` of the largest magnitude in `want` (at
/// least 1). NaN anywhere in `got` (an element no launch wrote) fails.
pub fn assert_close<T: Float>(got: &[T], want: &[T], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.f().abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.f() - w.f()).abs() / scale;
        assert!(err <= tol, "{what}: element {i} is {} where the CPU op has {} (relative error {err:e})", g.f(), w.f());
    }
}
