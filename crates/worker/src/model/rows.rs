//! Row-wise element work (norms, gates) on candle's pool: each output row is computed from its
//! own input row alone, so splitting the rows across threads never changes a bit.
//!
//! Why candle's pool and not rayon's (which candle's own row ops use): the matmuls and attention
//! run on candle's pool, and a second pool's threads spin after their work beside it, taking the
//! cores the next matmul needs (on two cores, rayon's idle spinning was 3% of a prefill's samples).

use std::ops::Range;

/// Outputs below which the work runs on the calling thread: waking the pool would cost more
/// (candle's own threshold for its element-wise ops).
const PARALLEL_MIN: usize = 64 * 1024;

/// A new `rows × width` buffer whose rows `f(range, out)` fills, `out` being rows `range` of it:
/// on the calling thread for little work, else split across candle's pool.
pub fn map_rows(rows: usize, width: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; rows * width];
    if rows * width < PARALLEL_MIN {
        f(0..rows, &mut out);
        return out;
    }
    let at = out.as_mut_ptr() as usize;
    candle_core::utils::barrier_pool().execute_chunked(rows, |range: Range<usize>| {
        // SAFETY: rows `range` of `out` belong to this call alone, and lie inside it.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((at as *mut f32).add(range.start * width), range.len() * width) };
        f(range, dst)
    });
    out
}
