//! With the `cuda` feature, compiles align's own CUDA kernels (`kernels/*.cu`) to PTX with nvcc,
//! so a kernel that does not compile fails the build (and CI's `cargo check --features cuda`).
//! Without the feature this does nothing. nvcc comes from `NVCC`, `PATH` or `CUDA_HOME`
//! (`scripts/cuda-toolchain.sh` installs one without a GPU); `CUDA_COMPUTE_CAP` picks the PTX
//! target (default 80, which newer GPUs JIT-compile).

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: [&str; 4] = ["channels", "depthwise", "optim", "rows"];

fn nvcc() -> PathBuf {
    if let Ok(p) = std::env::var("NVCC") {
        return p.into();
    }
    for var in ["CUDA_HOME", "CUDA_ROOT", "CUDA_PATH"] {
        if let Ok(home) = std::env::var(var) {
            let p = Path::new(&home).join("bin/nvcc");
            if p.is_file() {
                return p;
            }
        }
    }
    "nvcc".into()
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
    }
    println!("cargo:rerun-if-changed=kernels/reduce.cuh");
    for var in ["NVCC", "CUDA_HOME", "CUDA_ROOT", "CUDA_PATH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").ok().and_then(|c| c.trim().parse::<u32>().ok()).unwrap_or(80);
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    for k in KERNELS {
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "--std=c++17", "-o"])
            .arg(&ptx)
            .arg(format!("kernels/{k}.cu"))
            .status()
            .unwrap_or_else(|e| {
                panic!("the cuda feature needs nvcc ({}: {e}); run scripts/cuda-toolchain.sh or set NVCC / CUDA_HOME", nvcc.display())
            });
        assert!(status.success(), "nvcc failed on kernels/{k}.cu");
    }
}
