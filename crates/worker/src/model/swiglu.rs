//! SwiGLU's gate in one pass: `silu(gate) * up`, read straight from the fused gate-and-up matmul's
//! output. Candle's ops would copy each half out, run SiLU into a new tensor and multiply into a
//! third: three passes and three allocations a layer. The arithmetic is candle's, `g / (1 +
//! exp(-g))` then `* u` in f32 with the same `exp`, so the bits are the same (a test holds it to
//! candle's ops), and each value depends on its own row alone.

use anyhow::{Result, ensure};
use candle_core::{CpuStorage, Device, Storage, Tensor};

/// Outputs below which a step runs on the calling thread (candle's own threshold for its
/// element-wise ops).
const PARALLEL_MIN: usize = 64 * 1024;

/// `silu(y[.., ..width]) * y[.., width..]` for `y` of shape `(rows, 2 * width)`: shape
/// `(rows, width)`. Host tensors of f32 take the one pass; any other (a device's) takes candle's ops.
pub fn silu_gate(y: &Tensor, width: usize) -> Result<Tensor> {
    let (rows, both) = y.dims2()?;
    ensure!(both == 2 * width, "a gate and an up of {width} each, not {both} columns");
    let out = {
        let (storage, layout) = y.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) => Some(gate(&v[start..end], width)),
            _ => None,
        }
    };
    match out {
        Some(out) => Ok(Tensor::from_vec(out, (rows, width), &Device::Cpu)?),
        None => {
            let (g, u) = (y.narrow(1, 0, width)?.contiguous()?, y.narrow(1, width, width)?.contiguous()?);
            Ok((candle_nn::ops::silu(&g)? * u)?)
        }
    }
}

/// The gated values of rows of `[gate | up]`, many rows split across candle's pool.
fn gate(y: &[f32], width: usize) -> Vec<f32> {
    let rows = y.len() / (2 * width);
    let mut out = vec![0f32; rows * width];
    let at = out.as_mut_ptr() as usize;
    let work = |range: std::ops::Range<usize>| {
        // SAFETY: rows `range` of `out` belong to this call alone, and lie inside it.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((at as *mut f32).add(range.start * width), range.len() * width) };
        let src = &y[range.start * 2 * width..range.end * 2 * width];
        for (o, row) in dst.chunks_exact_mut(width).zip(src.chunks_exact(2 * width)) {
            let (g, u) = row.split_at(width);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }
    };
    if rows * width < PARALLEL_MIN {
        work(0..rows);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows, work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candle_gate(y: &Tensor, width: usize) -> Vec<f32> {
        let (g, u) = (y.narrow(1, 0, width).unwrap().contiguous().unwrap(), y.narrow(1, width, width).unwrap());
        let out = (candle_nn::ops::silu(&g).unwrap() * u.contiguous().unwrap()).unwrap();
        out.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn the_one_pass_gate_gives_candles_bits_for_a_few_rows_and_for_many() {
        // 3 rows of 37: on this thread; 64 rows of 1,536: across the pool (and past
        // saturation: values up to 40 in size, where exp overflows or vanishes).
        for (rows, width, spread) in [(3, 37, 4.0), (64, 1536, 40.0)] {
            let y = (Tensor::randn(0f32, 1.0, (rows, 2 * width), &Device::Cpu).unwrap() * spread).unwrap();
            let ours = silu_gate(&y, width).unwrap();
            assert_eq!(ours.dims(), [rows, width]);
            let ours: Vec<u32> =
                ours.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            let theirs: Vec<u32> = candle_gate(&y, width).iter().map(|x| x.to_bits()).collect();
            assert!(ours == theirs, "{rows}x{width}: the gate differs from candle's silu then multiply");
        }
    }

    #[test]
    fn a_gate_and_up_of_other_widths_is_refused() {
        let y = Tensor::zeros((2, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(silu_gate(&y, 4).is_err());
    }
}
