//! The `align` command line: parse, then call one function per subcommand.

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};

mod cli;

// candle allocates a fresh buffer for every op result; glibc returns large ones to the kernel
// each time (mmap/munmap), which showed up as a third of the training time in system calls.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

extern "C" {
    // Part of the mimalloc library the allocator above links; declared here because the crate
    // exposes it only behind a feature with an extra dependency.
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// `mi_option_purge_delay`: position 15 of `mi_option_t` in both mimalloc v2 and v3 (options are
/// deprecated in place, never renumbered, to keep the ABI).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// By default mimalloc hands freed memory back to the kernel after 10 ms. A training step frees
/// and reallocates gigabytes of activations, so every step paid for zeroing fresh pages again:
/// on ViT-Ti + BERT-mini that was 100k page faults and as much system time as user time, against
/// none once purging is off. Memory stays at the run's peak, which a training process reaches on
/// its first step anyway. `MIMALLOC_PURGE_DELAY` in the environment still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an integer option of the linked allocator; no memory is touched.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// rayon's idle workers call `sched_yield` up to 33 times before they sleep, at the end of every
/// parallel region. On a core shared with another process (another job on a cluster node, a
/// laptop's browser) each call hands that process the core for its time slice while the
/// region's other threads wait at the join: one busy process at nice 19 beside a ViT-B/32 bf16
/// embedding on two cores took the embedding from 34 to 24-27 images/s, where
/// PyTorch (whose OpenMP threads spin without yielding) kept its speed. Here a yield is instead a
/// spin of about as long as the system call takes when nothing else is waiting, so idle workers
/// still sleep after rayon's rounds but no longer give their core away. Under the same load the
/// embedding ran 29.0-29.5 images/s and a ViT-Ti/16 bf16 training step 22.4-25.3 samples/s
/// instead of 18.2-19.3; on idle cores nothing changed. Defined in the binary, it stands in for
/// the C library's for every caller in the process (rayon, crossbeam's backoff); the C library's
/// own internal calls are unaffected.
#[no_mangle]
pub extern "C" fn sched_yield() -> std::ffi::c_int {
    let until = std::time::Instant::now() + std::time::Duration::from_micros(2);
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
    0
}

/// candle runs its own element-wise kernels (the gradient sums of every backward pass among them)
/// on a second thread pool beside rayon's. On two cores its worker and rayon's two threads take
/// turns on the same cores, and handing each small op across costs more than the second thread
/// gains: an EfficientNet-B0 + BERT-mini step (batch 16) ran 9.66 and 9.95 samples/s with it
/// and 10.25 and 10.29 with those kernels on the calling thread; ViT-Ti was unchanged. Larger
/// machines keep candle's default, unmeasured here. `CANDLE_NUM_THREADS` in the environment wins.
fn candle_pool_on_small_machines() {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if cores <= 2 && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY (of the environment write): main has started no threads yet.
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// Batch jobs size their threads with `OMP_NUM_THREADS` (SLURM's `--cpus-per-task` scripts set
/// it); rayon reads only its own variable, so a job would start a thread per core of the whole
/// node beside the other jobs. `RAYON_NUM_THREADS` in the environment still wins.
fn threads_from_omp() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let omp = std::env::var("OMP_NUM_THREADS").ok();
    // OpenMP allows a list per nesting level; the first is the outer one.
    if let Some(n) = omp.as_deref().and_then(|v| v.split(',').next()?.trim().parse::<usize>().ok()).filter(|&n| n > 0) {
        // SAFETY (of the environment write): main has started no threads yet.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// A reader that goes away (`align inspect ... | head`) ends align quietly, as it ends any Unix
/// tool: Rust ignores SIGPIPE, which turns the next print into a panic instead.
fn quiet_on_closed_pipe() {
    // SAFETY: restores the default action of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[derive(Parser)]
#[command(name = "align", version, about = "Train and evaluate contrastive image-text dual encoders (ALIGN, CLIP)")]
struct Cli {
    /// Compute device: cpu, cuda or cuda:N (default: the first GPU if this build has CUDA and
    /// one is present, else the CPU).
    #[arg(long, global = true, value_name = "DEVICE")]
    device: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate synthetic data, train a small model on the CPU, evaluate it.
    Demo(cli::demo::DemoArgs),
    /// Train from a TOML config.
    Train(cli::train::TrainArgs),
    /// Every config field: its `--set` path, type, default and meaning (and a config's values
    /// with `--config`).
    Config(cli::config::ConfigArgs),
    /// Data tools: synthetic shards, statistics, clean shards from raw pairs, CLIP scores, Karpathy
    /// splits.
    #[command(subcommand)]
    Data(DataCommand),
    /// Tokenizer tools.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Evaluate a checkpoint.
    #[command(subcommand)]
    Eval(EvalCommand),
    /// Embed images and captions (or a text file) into a searchable index.
    Embed(cli::embed::EmbedArgs),
    /// Query an index with a text, an image, or an image plus / minus a text.
    Search(cli::embed::SearchArgs),
    /// Write a model in the Hugging Face layout of its towers, or in open_clip's format.
    Export(cli::embed::ExportArgs),
    /// Show what align understood of a checkpoint: format, towers, sizes, tokenizer,
    /// preprocessing, logit scale and bias.
    Inspect(cli::inspect::InspectArgs),
    /// Measure throughput.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Draw a run's curves (loss, temperature, lr, throughput, evaluations) as a PNG; several runs compare.
    Plot(cli::plot::PlotArgs),
    /// Start the local ranks of a multi-process job (torchrun's variables), stopping all if one fails.
    Launch(cli::launch::LaunchArgs),
    /// Print a shell's completion script: `align completions bash > ~/.local/share/bash-completion/completions/align`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages: `align.1` and one per subcommand (`align-train.1`, ...), into a directory.
    Man {
        /// The directory (created if missing), e.g. ~/.local/share/man/man1.
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write synthetic image-caption shards (train + test), classes.txt and templates.txt.
    Synth(cli::data::SynthArgs),
    /// Count samples, skips by reason, caption lengths and image sizes.
    Stats(cli::data::StatsArgs),
    /// Filter raw image/alt-text pairs into clean training shards (CC3M / CC12M / ALIGN presets,
    /// CLIP-score, MetaCLIP and deduplication filters).
    Build(cli::data::BuildArgs),
    /// Score every sample's image-text cosine with a checkpoint into Parquet files, for the
    /// model-based filters of `data build`.
    Score(cli::data::ScoreArgs),
    /// Convert a Karpathy split (Flickr30K, MSCOCO) and its image folder into shards.
    FromKarpathy(cli::data::FromKarpathyArgs),
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a WordPiece vocabulary on the captions of shards.
    Train(cli::data::TokenizerTrainArgs),
}

#[derive(Subcommand)]
enum EvalCommand {
    /// Image-text retrieval Recall@1/5/10 in both directions.
    Retrieval(cli::eval::RetrievalArgs),
    /// Zero-shot classification with prompt ensembles.
    Zeroshot(cli::eval::ZeroShotArgs),
    /// K-nearest-neighbour classification of image embeddings (train split as the index).
    Knn(cli::eval::KnnArgs),
    /// Linear probe: a logistic-regression classifier on frozen image embeddings, its weight decay
    /// chosen on held-out training images (ALIGN §5.2, CLIP_benchmark's linear_probe).
    LinearProbe(cli::eval::LinearProbeArgs),
    /// Several datasets for one or several checkpoints from a TOML file: one table, and one
    /// CLIP_benchmark JSON per (checkpoint, dataset).
    Suite(cli::eval_suite::SuiteArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Loader throughput in images per second.
    Loader(cli::bench::LoaderArgs),
    /// Training-step time (forward, backward, optimiser) and peak memory of a model.
    Model(cli::bench::ModelArgs),
    /// Forward-only embedding of a data set's images and captions: images/s and peak memory.
    Embed(cli::bench::EmbedArgs),
    /// The sigmoid loss over thread ranks, ring or gathered: time and peak memory.
    Loss(cli::bench::LossArgs),
    /// EfficientNet's depthwise layers: our op against candle's grouped convolution.
    Depthwise(cli::bench::DepthwiseArgs),
    /// The CPU's matrix product kernels (f32, bf16, int8) on a model's shapes: multiply-adds per
    /// second, against their instruction's rate issued back to back.
    Products(cli::bench::ProductsArgs),
    /// What each rank holds of the optimizer state and summed gradients with `train.shard`, at
    /// several numbers of thread ranks.
    Shard(cli::bench::ShardArgs),
    /// Every per-op kernel on the device (f32) against the CPU's f64 op, forward and backward,
    /// and the optimizer update, with time per call: the first run on a new GPU.
    Ops(cli::bench::OpsArgs),
}

fn main() {
    // A user's mistake (a missing file, a bad config value) is one line naming what is wrong, not
    // a stack trace, whatever RUST_BACKTRACE says; a panic (a bug) still prints its own.
    // Pipe commands feeding shards must not outlive the process, however it ends.
    align::util::interrupt::before_exit(align::data::pipe_source::kill_all);
    let result = run();
    align::util::interrupt::run_before_exit();
    if let Err(e) = result {
        eprintln!("error: {}", align::util::errors::one_line(&e));
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    quiet_on_closed_pipe();
    threads_from_omp();
    keep_freed_memory();
    align::util::log::init();
    candle_pool_on_small_machines();
    let cli = Cli::parse();
    align::util::profile::init_from_env();
    if matches!(
        cli.command,
        Command::Demo(_)
            | Command::Train(_)
            | Command::Eval(_)
            | Command::Embed(_)
            | Command::Search(_)
            | Command::Bench(_)
            | Command::Data(DataCommand::Score(_))
    ) {
        cli::select_device(cli.device.as_deref())?;
    }
    match cli.command {
        Command::Demo(a) => cli::demo::run(&a),
        Command::Train(a) => cli::train::run(&a),
        Command::Data(DataCommand::Synth(a)) => cli::data::synth(&a),
        Command::Data(DataCommand::Stats(a)) => cli::data::stats(&a),
        Command::Data(DataCommand::FromKarpathy(a)) => cli::data::from_karpathy(&a),
        Command::Data(DataCommand::Build(a)) => cli::data::build(&a),
        Command::Data(DataCommand::Score(a)) => cli::data::score(&a),
        Command::Tokenizer(TokenizerCommand::Train(a)) => cli::data::tokenizer_train(&a),
        Command::Eval(EvalCommand::Retrieval(a)) => cli::eval::retrieval(&a),
        Command::Eval(EvalCommand::Zeroshot(a)) => cli::eval::zeroshot(&a),
        Command::Eval(EvalCommand::Knn(a)) => cli::eval::knn(&a),
        Command::Eval(EvalCommand::LinearProbe(a)) => cli::eval::linear_probe(&a),
        Command::Eval(EvalCommand::Suite(a)) => cli::eval_suite::suite(&a),
        Command::Embed(a) => cli::embed::embed(&a),
        Command::Launch(a) => cli::launch::run(&a),
        Command::Plot(a) => cli::plot::run(&a),
        Command::Config(a) => cli::config::run(a),
        Command::Search(a) => cli::embed::search(&a),
        Command::Export(a) => cli::embed::export(&a),
        Command::Inspect(a) => cli::inspect::run(&a),
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "align", &mut script);
            use std::io::Write;
            std::io::stdout().write_all(&script).context("writing the completion script")
        }
        Command::Man { out } => {
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            clap_mangen::generate_to(Cli::command(), &out).with_context(|| format!("writing man pages into {}", out.display()))?;
            println!("man pages written to {} (read one with: man -l {}/align.1)", out.display(), out.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Loader(a)) => cli::bench::loader(&a),
        Command::Bench(BenchCommand::Model(a)) => cli::bench::model(&a),
        Command::Bench(BenchCommand::Depthwise(a)) => cli::bench::depthwise(&a),
        Command::Bench(BenchCommand::Products(a)) => cli::bench::products(&a),
        Command::Bench(BenchCommand::Loss(a)) => cli::bench::loss(&a),
        Command::Bench(BenchCommand::Shard(a)) => cli::bench::shard(&a),
        Command::Bench(BenchCommand::Embed(a)) => cli::bench::embed(&a),
        Command::Bench(BenchCommand::Ops(a)) => cli::bench::ops(&a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand and every option says what it is for in `--help` (and so in the man
    /// pages and completions).
    #[test]
    fn every_command_and_option_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if !matches!(id, "help" | "version") && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() {
                    missing.push(name.clone());
                }
                walk(sub, &name, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "align", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }
}
