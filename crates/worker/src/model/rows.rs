//! Row-wise work (norms, gates, the sampler's rows) on candle's pool: each output row is computed
//! from its own input row alone, so splitting the rows across threads never changes a bit.
//!
//! Why candle's pool and not rayon's (which candle's own row ops use): the matmuls and attention
//! run on candle's pool, and a second pool's threads spin after their work beside it, taking the
//! cores the next matmul needs (on two cores, rayon's idle spinning was 3% of a prefill's samples).

use std::ops::Range;

use candle_core::{CpuStorage, Storage, Tensor};

/// Outputs below which the work runs on the calling thread: waking the pool would cost more
/// (candle's own threshold for its element-wise ops).
pub(crate) const PARALLEL_MIN: usize = 64 * 1024;

/// Writes rows `range` of some row-wise result into `out` (`range.len()` rows, every element
/// written), from those rows' inputs alone: a norm's or a gate's, handed to whoever stores the
/// rows (`map_rows`) or consumes them as they are made (the int8 matmul's quantization).
pub type RowFill<'a> = dyn Fn(Range<usize>, &mut [f32]) + Sync + 'a;

/// `f` of a tensor's values, where it is a contiguous f32 tensor in host memory (else `None`: a
/// device's, or another type, for candle's ops to take).
pub fn on_host<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Option<T> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((start, end))) => Some(f(&v[start..end])),
        _ => None,
    }
}

/// A new `rows × width` buffer whose rows `f(range, out)` fills, `out` being rows `range` of it:
/// on the calling thread for little work, else split across candle's pool. Each call zeroes its
/// own rows just before `f` writes them (a memset of the whole buffer up front was 2% of a
/// prefill's samples, on one thread while the others waited).
pub fn map_rows(rows: usize, width: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = Vec::<f32>::with_capacity(rows * width);
    let at = out.as_mut_ptr() as usize;
    let fill = |range: Range<usize>| {
        let len = range.len() * width;
        // SAFETY: rows `range` lie inside the capacity and belong to this call alone; they are
        // zeroed (every bit pattern of an f32 is valid) before the slice is made.
        let dst = unsafe {
            let p = (at as *mut f32).add(range.start * width);
            p.write_bytes(0, len);
            std::slice::from_raw_parts_mut(p, len)
        };
        f(range, dst)
    };
    if rows * width < PARALLEL_MIN {
        fill(0..rows);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows, fill);
    }
    // SAFETY: the calls together zeroed (then filled) every row.
    unsafe { out.set_len(rows * width) };
    out
}

/// Each row of `v` cut into side-by-side column ranges of `widths`, every range gathered into its
/// own buffer (part `i` is `rows × widths[i]`): copies only, with no zeroing first (a fused
/// projection's outputs split into their parts, every step). On the calling thread for little
/// work, else split by rows across candle's pool (a prefill's copies on the calling thread alone
/// were 0.7% of its samples, the other threads waiting).
pub fn split_columns(v: &[f32], widths: &[usize]) -> Vec<Vec<f32>> {
    let row: usize = widths.iter().sum();
    let rows = v.len() / row;
    let mut parts: Vec<Vec<f32>> = widths.iter().map(|&w| Vec::with_capacity(rows * w)).collect();
    // (where the part's rows start, the columns' offset in a row of `v`, their width) per part.
    let mut at = 0;
    let cuts: Vec<(usize, usize, usize)> = parts
        .iter_mut()
        .zip(widths)
        .map(|(part, &w)| {
            at += w;
            (part.as_mut_ptr() as usize, at - w, w)
        })
        .collect();
    let fill = |range: Range<usize>| {
        for r in range {
            for &(dst, at, w) in &cuts {
                let src = &v[r * row + at..][..w];
                // SAFETY: row `r` of each part lies inside its capacity and belongs to this call
                // alone; `src` is `w` floats of `v`, which no part overlaps.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (dst as *mut f32).add(r * w), w) };
            }
        }
    };
    if v.len() < PARALLEL_MIN {
        fill(0..rows);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows, fill);
    }
    for (part, &w) in parts.iter_mut().zip(widths) {
        // SAFETY: the calls together wrote every row of every part.
        unsafe { part.set_len(rows * w) };
    }
    parts
}

/// `f` on every item, the items split across candle's pool (each item is handed to exactly one
/// call of `f`); a single item stays on the calling thread.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    if let [item] = items {
        return f(item);
    }
    let at = items.as_mut_ptr() as usize;
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            // SAFETY: `execute_chunked` hands each index below `items.len()` to exactly one
            // range, so no two calls reach the same item; `items` outlives the call.
            f(unsafe { &mut *(at as *mut T).add(i) })
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_each_mut_hands_every_item_to_exactly_one_call() {
        for n in [0, 1, 2, 3, 17, 64, 1_000] {
            let mut items: Vec<(usize, u32)> = (0..n).map(|i| (i, 0)).collect();
            for_each_mut(&mut items, |(i, visits)| {
                *visits += 1;
                *i *= 2;
            });
            assert!(items.iter().enumerate().all(|(i, &(x, v))| x == 2 * i && v == 1), "{n} items: {items:?}");
        }
    }

    #[test]
    fn split_columns_gives_each_part_its_own_columns_of_every_row_on_any_split() {
        let widths = [576, 192, 256]; // 300 rows pass the parallel threshold
        for rows in [1, 7, 300] {
            let row: usize = widths.iter().sum();
            let v: Vec<f32> = (0..rows * row).map(|i| i as f32).collect();
            let parts = split_columns(&v, &widths);
            let mut at = 0;
            for (part, &w) in parts.iter().zip(&widths) {
                let expected: Vec<f32> = (0..rows).flat_map(|r| v[r * row + at..][..w].to_vec()).collect();
                assert_eq!(part, &expected, "{rows} rows, the part of {w} columns from {at}");
                at += w;
            }
        }
    }

    #[test]
    fn map_rows_fills_each_row_from_its_own_range_on_any_split() {
        for rows in [1, 7, 300] {
            let width = 1_024; // 300 rows pass the parallel threshold
            let out = map_rows(rows, width, |range, out| {
                for (r, row) in range.zip(out.chunks_mut(width)) {
                    row.iter_mut().enumerate().for_each(|(c, x)| *x += (r * width + c) as f32);
                }
            });
            assert!(out.iter().enumerate().all(|(i, &x)| x == i as f32), "{rows} rows");
        }
    }
}
