//! What a GPU op runs, as plain data: the kernel files and their launch parameters (each
//! `#[repr(C)]` struct field for field as its `.cu` file declares it), and the [`Program`] of
//! launches, buffers and grids an op plans for one of the executors.

/// `struct RowParams` of `kernels/rows.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RowParams {
    pub(super) rows: i64,
    pub(super) cols: i32,
    pub(super) rows_per_bias: i32,
    pub(super) chunk: i32,
    pub(super) act: i32,
    pub(super) value: f64,
}

/// `struct ChannelParams` of `kernels/channels.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ChannelParams {
    pub(super) n: i32,
    pub(super) c: i32,
    pub(super) hw: i64,
    pub(super) silu: i32,
    pub(super) batch_stats: i32,
}

/// `struct Geometry` of `kernels/depthwise.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DepthwiseParams {
    pub n: i32,
    pub c: i32,
    pub h: i32,
    pub w: i32,
    pub k: i32,
    pub stride: i32,
    pub top: i32,
    pub left: i32,
    pub ho: i32,
    pub wo: i32,
}

/// `struct OptimParams` of `kernels/optim.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OptimParams {
    pub n: i64,
    pub ratio_at: i64,
    pub lr: f32,
    pub clip: f32,
    pub b1: f32,
    pub b2: f32,
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub eps: f32,
    pub wd: f32,
    pub lamb: i32,
    pub unused: i32,
}

/// The kernel files: `build.rs` compiles each `kernels/NAME.cu` to PTX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Module {
    Rows,
    Channels,
    Depthwise,
    Optim,
}

impl Module {
    #[cfg(test)]
    pub const ALL: [Module; 4] = [Module::Rows, Module::Channels, Module::Depthwise, Module::Optim];

    /// The file's name under `kernels/`, without `.cu`.
    pub fn file(self) -> &'static str {
        match self {
            Module::Rows => "rows",
            Module::Channels => "channels",
            Module::Depthwise => "depthwise",
            Module::Optim => "optim",
        }
    }

    /// The element type of the kernels' side buffer.
    pub fn side_is_f32(self) -> bool {
        self == Module::Rows
    }

    #[cfg(feature = "cuda")]
    pub fn ptx(self) -> &'static str {
        match self {
            Module::Rows => include_str!(concat!(env!("OUT_DIR"), "/rows.ptx")),
            Module::Channels => include_str!(concat!(env!("OUT_DIR"), "/channels.ptx")),
            Module::Depthwise => include_str!(concat!(env!("OUT_DIR"), "/depthwise.ptx")),
            Module::Optim => include_str!(concat!(env!("OUT_DIR"), "/optim.ptx")),
        }
    }
}

/// A launch's parameter struct, which also says which kernel file the kernel is in.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Params {
    Row(RowParams),
    Channel(ChannelParams),
    Depthwise(DepthwiseParams),
    Optim(OptimParams),
}

impl Params {
    pub fn module(&self) -> Module {
        match self {
            Params::Row(_) => Module::Rows,
            Params::Channel(_) => Module::Channels,
            Params::Depthwise(_) => Module::Depthwise,
            Params::Optim(_) => Module::Optim,
        }
    }
}

// SAFETY (all four): #[repr(C)] structs of plain numbers, laid out as the kernels' structs.
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for RowParams {}
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for ChannelParams {}
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for DepthwiseParams {}
#[cfg(feature = "cuda")]
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for OptimParams {}

/// An op's side buffer: values computed on the host that a kernel reads besides its operands
/// (`rows.cu`: the softmax's f32 key bias; `channels.cu`: f64 BatchNorm statistics or sample
/// factors).
#[derive(Clone, Debug)]
pub(crate) enum SideBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Where a launch reads an operand from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Src {
    /// The op's n-th input.
    Operand(usize),
    /// A scratch buffer an earlier launch wrote.
    Scratch(usize),
    /// Not read by the kernel (a null pointer).
    Null,
}

/// Where a launch writes: `len` elements from `offset` of the op's output or of a scratch buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dst {
    Out { offset: usize, len: usize },
    Scratch(usize),
}

#[derive(Clone, Debug)]
pub(crate) struct Launch {
    /// The kernel's name without its dtype suffix.
    pub kernel: &'static str,
    pub inputs: [Src; 3],
    /// Whether the kernel reads the op's side buffer.
    pub side: bool,
    pub out: Dst,
    pub params: Params,
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

/// An op's launches, the lengths of the scratch buffers they pass between them, and the length
/// of the op's output.
#[derive(Clone, Debug)]
pub(crate) struct Program {
    pub launches: Vec<Launch>,
    pub scratch: Vec<usize>,
    pub out_len: usize,
}

impl Program {
    pub(super) fn one(launch: Launch, out_len: usize) -> Program {
        Program { launches: vec![launch], scratch: vec![], out_len }
    }
}

/// Launch limits. Grids are capped so that the kernels' grid-stride loops are exercised in the
/// tests with a small cap; on a GPU the cap only bounds the launch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_grid: u32,
    /// Dynamic shared memory a block may ask for without opting in (48 KiB on every CUDA GPU).
    pub max_shared: usize,
}

pub(crate) const MAX_GRID: u32 = 65_535;
pub(crate) const GPU: Limits = Limits { max_grid: MAX_GRID, max_shared: 48 * 1024 };

/// Threads for the elementwise and column kernels.
pub(super) const THREADS: u32 = 256;

pub(super) fn grid(units: usize, limits: &Limits) -> u32 {
    units.clamp(1, limits.max_grid as usize) as u32
}

/// The dtype suffix of a kernel's name: `kernels/*.cu` instantiate each in f32 and f64.
#[cfg(any(test, feature = "cuda"))]
pub(super) fn kernel_suffix<T: crate::ops::Float>() -> &'static str {
    if std::mem::size_of::<T>() == 4 {
        "f32"
    } else {
        "f64"
    }
}

/// Small grids, so that every kernel's grid-stride loop takes more than one turn.
#[cfg(test)]
pub(crate) const SMALL_GRID: Limits = Limits { max_grid: 7, max_shared: 48 * 1024 };
