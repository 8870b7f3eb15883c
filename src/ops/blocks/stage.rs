//! Stages: ops run outside candle's graph and kept with their operands, so that a block op
//! chaining several runs their backward passes itself.

use candle_core::Result;

/// A three-operand op run outside candle's graph on detached operands and kept with them, so
/// that an op chaining several (`ops::mbconv`) runs their backward passes itself.
pub struct Stage<C> {
    op: C,
    args: [candle_core::Tensor; 3],
}

impl<C: candle_core::CustomOp3> Stage<C> {
    pub(crate) fn run(op: C, args: [&candle_core::Tensor; 3]) -> Result<(candle_core::Tensor, Self)> {
        let [a, b, c] = args.map(|t| t.detach().contiguous());
        let args = [a?, b?, c?];
        let y = args[0].apply_op3_no_bwd(&args[1], &args[2], &op)?;
        Ok((y, Stage { op, args }))
    }

    /// The gradients of the three operands, from the output's.
    pub fn backward(&self, grad: &candle_core::Tensor) -> Result<(candle_core::Tensor, candle_core::Tensor, candle_core::Tensor)> {
        let [a, b, c] = &self.args;
        let (Some(da), Some(db), Some(dc)) = self.op.bwd(a, b, c, grad, grad)? else {
            candle_core::bail!("{}: backward pass without every gradient", self.op.name())
        };
        Ok((da, db, dc))
    }
}
