//! `align bench depthwise`: EfficientNet's depthwise layers, align's op against candle's grouped
//! convolution.

use std::time::Instant;

use align::util::progress::Progress;

use anyhow::Result;
use clap::Args;
use serde::Serialize;

#[derive(Args)]
pub struct DepthwiseArgs {
    /// EfficientNet preset whose depthwise layers are timed.
    #[arg(long, default_value = "efficientnet-b0")]
    pub image_tower: String,
    /// Images per call.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Input side in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct DepthwiseRow {
    block: usize,
    channels: usize,
    input: usize,
    kernel: usize,
    stride: usize,
    fused_ms: f64,
    candle_ms: f64,
}

/// Forward + backward of every depthwise layer of a network, our op against candle's grouped conv.
pub fn depthwise(a: &DepthwiseArgs) -> Result<()> {
    use align::model::efficientnet::{EfficientNet, EfficientNetConfig};
    use align::model::init::SeededVars;
    use align::ops::kernels::depthwise::composed as candle_depthwise;
    use align::ops::kernels::depthwise::depthwise_conv2d;
    use candle_core::{Tensor, Var};

    let Some(cfg) = EfficientNetConfig::preset(&a.image_tower, a.image_size) else {
        anyhow::bail!("{} is not an EfficientNet preset", a.image_tower)
    };
    let device = crate::cli::default_device();
    let net = EfficientNet::new(&cfg, SeededVars::builder(&candle_nn::VarMap::new(), 0, &device))?;
    let layers = net.depthwise_layers();
    let bar = Progress::bar(layers.len() as u64, "layers", a.json);
    let mut rows = Vec::new();
    for (block, l) in layers.iter().enumerate() {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (a.batch, l.channels, l.input, l.input), &device)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.1, (l.channels, 1, l.kernel, l.kernel), &device)?)?;
        let time = |fused: bool| -> Result<f64> {
            let t0 = Instant::now();
            let y = if fused {
                depthwise_conv2d(x.as_tensor(), w.as_tensor(), l.stride, l.pad)?
            } else {
                candle_depthwise(x.as_tensor(), w.as_tensor(), l.stride, l.pad)?
            };
            let g = y.sum_all()?.backward()?;
            g.get(x.as_tensor()).map(|t| t.dims().len()).unwrap_or(0);
            Ok(1000.0 * t0.elapsed().as_secs_f64())
        };
        time(true)?;
        rows.push(DepthwiseRow {
            block,
            channels: l.channels,
            input: l.input,
            kernel: l.kernel,
            stride: l.stride,
            fused_ms: time(true)?,
            candle_ms: time(false)?,
        });
        bar.inc(1);
    }
    bar.finish();
    let (f, c): (f64, f64) = rows.iter().fold((0.0, 0.0), |(f, c), r| (f + r.fused_ms, c + r.candle_ms));
    if a.json {
        return crate::cli::print_json(&serde_json::json!({"layers": rows, "fused_ms": f, "candle_ms": c, "speedup": c / f}));
    }
    println!(
        "{:>5} {:>8} {:>6} {:>3} {:>3} {:>10} {:>10} {:>8}",
        "block", "channels", "input", "k", "s", "fused ms", "candle ms", "speedup"
    );
    for r in &rows {
        println!(
            "{:>5} {:>8} {:>6} {:>3} {:>3} {:>10.1} {:>10.1} {:>7.1}x",
            r.block,
            r.channels,
            r.input,
            r.kernel,
            r.stride,
            r.fused_ms,
            r.candle_ms,
            r.candle_ms / r.fused_ms
        );
    }
    println!("total: fused {f:.0} ms, candle {c:.0} ms, {:.1}x (forward + backward, batch {})", c / f, a.batch);
    Ok(())
}
