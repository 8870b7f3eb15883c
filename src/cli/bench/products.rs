//! `align bench products`: the product kernels' multiply-adds per second on a model's shapes,
//! against the rate of their instruction issued back to back (the CPU's ceiling) at each
//! precision.

use align::config::Precision;
use align::ops::kernels::peak::{self, instruction_peak, product_rate};
use anyhow::Result;
use clap::Args;
use serde::Serialize;

use crate::cli::table::Table;

#[derive(Args)]
pub struct ProductsArgs {
    /// Products as ROWSxINxOUT (a linear layer's x `[rows, in]` times Wᵀ, W `[out, in]`),
    /// comma-separated. The default is ViT-B/32's at batch 64 (3,200 tokens): the attention
    /// projections, the MLP's two layers.
    #[arg(long, value_delimiter = ',', default_value = "3200x768x768,3200x768x3072,3200x3072x768")]
    pub shapes: Vec<String>,
    /// Precisions to time.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16,int8")]
    pub precision: Vec<Precision>,
    /// Timed calls per product (the median counts), after one warm-up.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Seconds each thread issues the instruction for to find the ceiling.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct ProductRow {
    precision: &'static str,
    rows: usize,
    input: usize,
    output: usize,
    gmac_per_s: f64,
    /// Of the instruction's rate on as many threads.
    share_of_peak: f64,
}

#[derive(Serialize)]
struct PeakRow {
    precision: &'static str,
    /// The instruction the precision's products run on, whose rate this is.
    instruction: &'static str,
    threads: usize,
    gmac_per_s: f64,
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let parts: Vec<usize> = s.split('x').map(|p| p.trim().parse::<usize>()).collect::<Result<_, _>>().map_err(|_| shape_error(s))?;
    match parts[..] {
        [m, k, n] if m > 0 && k > 0 && n > 0 => Ok((m, k, n)),
        _ => Err(shape_error(s)),
    }
}

fn shape_error(s: &str) -> anyhow::Error {
    anyhow::anyhow!("--shapes: {s:?} is not ROWSxINxOUT with three positive numbers (3200x768x3072)")
}

pub fn products(a: &ProductsArgs) -> Result<()> {
    let shapes = a.shapes.iter().map(|s| parse_shape(s)).collect::<Result<Vec<_>>>()?;
    let threads = rayon::current_num_threads();
    let mut peaks = Vec::new();
    let mut rows = Vec::new();
    for &p in &a.precision {
        let kernel = match p {
            Precision::F32 => peak::Precision::F32,
            Precision::Bf16 => peak::Precision::Bf16,
            Precision::Int8 => peak::Precision::Int8,
        };
        // The precision's own instruction where the CPU lacks it, so the peak is None then.
        let instruction = peak::kernel_instruction(kernel);
        let Some(peak) = instruction_peak(instruction, threads, a.seconds) else {
            eprintln!("{}: this CPU lacks the instruction; skipped", p.name());
            continue;
        };
        let instruction = peak::instruction_name(instruction);
        peaks.push(PeakRow { precision: p.name(), instruction, threads, gmac_per_s: peak / 1e9 });
        for &(m, k, n) in &shapes {
            let Some(rate) = product_rate(kernel, (m, k, n), a.reps) else { continue };
            rows.push(ProductRow { precision: p.name(), rows: m, input: k, output: n, gmac_per_s: rate / 1e9, share_of_peak: rate / peak });
        }
    }
    if a.json {
        return crate::cli::print_json(&serde_json::json!({"threads": threads, "peaks": peaks, "products": rows}));
    }
    let mut t = Table::new(&format!("matrix products on {threads} threads: GMAC/s, and share of the instruction's own rate"));
    for p in &peaks {
        t.row(format!("{} products' {}, back to back", p.precision, p.instruction), format!("{:>8.1}", p.gmac_per_s));
    }
    for r in &rows {
        t.row(
            format!("{} {}x{}x{}", r.precision, r.rows, r.input, r.output),
            format!("{:>8.1}   {:>5.1}%", r.gmac_per_s, 100.0 * r.share_of_peak),
        );
    }
    t.print();
    Ok(())
}

/// The instruction this process's bf16 products run on, as `bench model` and `bench embed`
/// report it (only where the CPU has AVX-512 BF16).
pub(super) fn bf16_products_instruction() -> &'static str {
    peak::instruction_name(peak::kernel_instruction(peak::Precision::Bf16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_name_themselves() {
        assert_eq!(parse_shape("3200x768x3072").unwrap(), (3200, 768, 3072));
        for bad in ["3200x768", "0x1x1", "ax1x1", "1x2x3x4"] {
            let e = parse_shape(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }
}
