//! `scripts/gpu-proof.sh --device cpu`: the GPU proof's dry run, every step on the CPU with tiny
//! sizes, so that the script, its helper and the report are known to work before a GPU is lent.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Whether `program --version` runs: the dry run needs bash and Python 3 (standard library only).
fn available(program: &str) -> bool {
    Command::new(program).arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

#[test]
fn the_gpu_proof_dry_run_passes_on_the_cpu_and_writes_its_report() {
    dry_run(true);
}

/// On a CPU without AVX-512 (here one told to act so) bf16 has no path: the dry run skips those
/// rows with align's refusal, and everything else still passes.
#[test]
fn the_dry_run_skips_bf16_on_a_cpu_without_avx512() {
    dry_run(false);
}

fn dry_run(avx512: bool) {
    for program in ["bash", "python3"] {
        if !available(program) {
            eprintln!("skipped: {program} is not available to run scripts/gpu-proof.sh");
            return;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("proof");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-proof.sh");
    let run = Command::new("bash")
        .arg(&script)
        .args(["--device", "cpu", "--align", env!("CARGO_BIN_EXE_align"), "--out"])
        .arg(&out)
        // Scratch data inside the test's folder, removed with it.
        .env("GPU_PROOF_WORK", dir.path().join("work"))
        .envs((!avx512).then_some(("ALIGN_NO_AVX512", "1")))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", run.status.code());

    let table = std::fs::read_to_string(out.join("gpu-proof.table")).unwrap();
    assert_eq!(table, stdout, "the table printed is the table written");
    for heading in ["1. Kernels", "2. Demo model", "3. Training step", "4. Loader", "5. Forward-only embedding", "Targets", "Overall: PASS"]
    {
        assert!(table.contains(heading), "{heading:?} missing from\n{table}");
    }

    let v: Value = serde_json::from_str(&std::fs::read_to_string(out.join("gpu-proof.json")).unwrap()).unwrap();
    assert_eq!(v["device"]["mode"], "cpu", "{v}");
    assert_eq!(v["passed"], true, "{}", v["failures"]);

    // 5: the trained checkpoint embeds the loader's shards on the forward-only path.
    let embed = &v["steps"]["embed"];
    assert_eq!(embed["status"], "done", "{embed}");
    assert!(embed["images"].as_u64().unwrap() > 0 && embed["images_per_s"].as_f64().unwrap() > 0.0, "{embed}");

    // 1: every kernel within the tolerance.
    let ops = &v["steps"]["ops"];
    assert_eq!(ops["status"], "pass", "{ops}");
    assert_eq!(ops["tolerance"], 1e-4);
    let rows = ops["rows"].as_array().unwrap();
    assert!(rows.len() >= 10, "{ops}");
    assert!(rows.iter().all(|r| r["pass"] == true), "{ops}");

    // 2: the same steps on the "device" (here the CPU again) against the CPU reference; the f32
    // runs are the same computation, so they agree to the last bit.
    let training = &v["steps"]["training"];
    assert_eq!(training["status"], "pass", "{training}");
    assert_eq!(training["reference"], "cpu-f32");
    for key in ["f32_max_rel", "bf16_mean_rel", "bf16_max_rel"] {
        assert!(training["tolerances"][key].as_f64().unwrap() > 0.0, "{key}: {training}");
    }
    let steps = training["steps"].as_u64().unwrap();
    let runs = training["rows"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["run"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "cpu-f32-align",
            "cpu-f32-candle",
            "cpu-bf16-align",
            "cpu-bf16-candle",
            "cpu-f32-align-sigmoid-flip-ema",
            "cpu-f32-align-distill-lock",
            "cpu-f32-align-shard-ranks",
            "cpu-f32-align-clip-start",
            "cpu-f32-align-naflex-start",
            "cpu-f32-align-timm-siglip-start"
        ]
    );
    // The sigmoid loss with patch dropout and a moving average, distillation with a locked
    // tower, two ranks with sharded state, and fine-tunes of CLIP, SigLIP 2 NaFlex and timm-trunk
    // SigLIP checkpoints, each against its own CPU run.
    let references: Vec<&str> = runs.iter().map(|r| r["reference"].as_str().unwrap()).collect();
    assert_eq!(
        references,
        [
            "cpu-f32",
            "cpu-f32",
            "cpu-f32",
            "cpu-f32",
            "cpu-f32-sigmoid-flip-ema",
            "cpu-f32-distill-lock",
            "cpu-f32-shard-ranks",
            "cpu-f32-clip-start",
            "cpu-f32-naflex-start",
            "cpu-f32-timm-siglip-start"
        ]
    );
    // A CPU without AVX-512 BF16 (or one told to act so with `ALIGN_NO_AVX512`) has no bf16
    // path: align refuses, and the dry run skips those rows with the refusal, failing nothing.
    let lacks_bf16 = !avx512 || !align::ops::kernels::bf16_gemm::available();
    for r in runs {
        if lacks_bf16 && r["precision"] == "bf16" {
            assert!(r["pass"].is_null() && r["skipped"].as_str().is_some_and(|s| s.contains("AVX-512 BF16")), "{r}");
            continue;
        }
        assert_eq!(r["pass"], true, "{r}");
        assert_eq!(r["steps_compared"].as_u64(), Some(steps), "{r}");
        if r["precision"] == "f32" {
            assert_eq!(r["max_rel"].as_f64(), Some(0.0), "{r}");
        }
    }

    // 3: both stand-in models in both precisions, the batch found by halving (the dry run counts
    // batches above 4 as out of memory), with align's figures; PyTorch's when it is installed.
    let model = &v["steps"]["model"];
    assert_eq!(model["status"], "done", "{model}");
    let rows = model["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{model}");
    for r in rows {
        if lacks_bf16 && r["precision"] == "bf16" {
            let error = r["align_error"].as_str().unwrap_or_default();
            assert!(r["batch"].is_null() && error.starts_with("skipped") && error.contains("AVX-512 BF16"), "{r}");
            continue;
        }
        assert_eq!(r["batch"], 4, "{r}");
        if r["precision"] == "bf16" {
            // bf16 starts from the model's first batch, 8; f32 from bf16's.
            assert_eq!((r["attempts"][0]["batch"].as_u64(), r["attempts"][0]["outcome"].as_str()), (Some(8), Some("oom")), "{r}");
        }
        assert!(r["align_samples_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["torch"].is_object() || r["torch_skipped"].is_string(), "{r}");
    }

    // 4: the loader's rate.
    let loader = &v["steps"]["loader"];
    assert_eq!(loader["status"], "done", "{loader}");
    assert!(loader["images_per_s"].as_f64().unwrap() > 0.0, "{loader}");

    let targets = v["targets"].as_array().unwrap();
    assert!(targets.iter().any(|t| t["target"] == "every row of (1) and (2) passes" && t["met"] == true), "{targets:?}");
}
