//! The matrix layouts a GPU product accepts. The CPU's gemm reads any strides, but candle's CUDA
//! matmul hands each operand to cuBLAS as it lies, with the leading dimension fixed to the
//! matrix's own width (or height, transposed): a column block narrowed out of a wider matrix is
//! an error there ("matmul is only supported for contiguous tensors") that no CPU run shows.
//! Operands that may be such views go through [`packed`] before a product.

use candle_core::{Result, Tensor};

/// Whether candle's CUDA matmul takes `t` as an operand as it lies: its last two dimensions
/// packed row by row, or column by column (a transposed packed matrix), by candle's own rule,
/// which forgives a stride only along a dimension of size 1 (so a single column cut from a wider
/// matrix is refused). Leading (batch) dimensions are not judged here.
pub fn gpu_accepts(t: &Tensor) -> bool {
    let (dims, stride) = (t.dims(), t.stride());
    if dims.len() < 2 {
        return true;
    }
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let (row_stride, col_stride) = (stride[stride.len() - 2], stride[stride.len() - 1]);
    let by_rows = (col_stride == 1 || cols == 1) && (row_stride == cols || rows == 1);
    let by_columns = (row_stride == 1 || rows == 1) && (col_stride == rows || cols == 1);
    by_rows || by_columns
}

/// `t` itself when a GPU product takes it as it lies, else a packed copy (on any device, so that
/// the CPU runs the same values through the same path).
pub fn packed(t: &Tensor) -> Result<Tensor> {
    if gpu_accepts(t) {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn matrix(rows: usize, cols: usize) -> Tensor {
        Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu).unwrap().reshape((rows, cols)).unwrap()
    }

    #[test]
    fn a_column_block_of_a_wider_matrix_is_refused_and_packed() {
        // The ring of SigLIP's loss carries [texts | their gradients] side by side: the texts
        // are columns 0..128 of a 128 × 256 block, and the product takes them transposed.
        let side_by_side = matrix(128, 256);
        let texts = side_by_side.narrow(1, 0, 128).unwrap();
        assert_eq!(texts.stride(), [256, 1]);
        assert!(!gpu_accepts(&texts));
        assert!(!gpu_accepts(&texts.t().unwrap()), "stride [1, 256], the layout the GPU refused");
        let p = packed(&texts).unwrap();
        assert!(gpu_accepts(&p) && gpu_accepts(&p.t().unwrap()));
        assert!(p.is_contiguous());
        let (a, b) = (p.to_vec2::<f32>().unwrap(), texts.to_vec2::<f32>().unwrap());
        assert_eq!(a, b, "the same values");
    }

    #[test]
    fn packed_matrices_their_transposes_and_row_blocks_are_taken_as_they_lie() {
        let m = matrix(6, 4);
        for t in [
            m.clone(),
            m.t().unwrap(),
            m.narrow(0, 2, 3).unwrap(),
            m.narrow(0, 2, 3).unwrap().t().unwrap(),
            m.narrow(0, 4, 1).unwrap(),
            Tensor::zeros((3, 5, 2), DType::F32, &Device::Cpu).unwrap(),
        ] {
            assert!(gpu_accepts(&t), "{:?} {:?}", t.dims(), t.stride());
            // Nothing is copied: the same storage, the same layout.
            let p = packed(&t).unwrap();
            assert_eq!((p.stride(), p.layout().start_offset()), (t.stride(), t.layout().start_offset()));
        }
        // A single column of a wider matrix too: candle's rule judges the row stride even there.
        for t in [
            m.narrow(1, 0, 2).unwrap(),
            m.narrow(1, 1, 2).unwrap().t().unwrap(),
            m.narrow(1, 1, 1).unwrap(),
            m.narrow(1, 3, 1).unwrap().t().unwrap(),
        ] {
            assert!(!gpu_accepts(&t), "{:?} {:?}", t.dims(), t.stride());
            assert!(gpu_accepts(&packed(&t).unwrap()));
        }
    }
}
