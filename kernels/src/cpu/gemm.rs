//! Matrix products through `matrixmultiply`, behind a safe, bounds-checked
//! front. The only unsafe code of the model.

/// A row-major matrix operand: `rows x cols` read from `data`, transposed
/// on the fly when `transposed` (then `data` holds `cols x rows`).
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    /// The elements.
    pub data: &'a [f32],
    /// Rows of the operand as used in the product.
    pub rows: usize,
    /// Columns of the operand as used in the product.
    pub cols: usize,
    /// Whether `data` is stored as the transpose.
    pub transposed: bool,
}

impl<'a> Operand<'a> {
    /// `data` as a `rows x cols` row-major matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Operand {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// `data`, stored as `cols x rows`, used as its transpose.
    pub fn t(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Operand {
            data,
            rows,
            cols,
            transposed: true,
        }
    }

    fn strides(&self) -> (isize, isize) {
        if self.transposed {
            (1, self.rows as isize)
        } else {
            (self.cols as isize, 1)
        }
    }
}

/// `c = a * b + beta * c`, with `c` row-major `a.rows x b.cols`.
pub fn gemm(a: Operand<'_>, b: Operand<'_>, beta: f32, c: &mut [f32]) {
    fn strided(o: Operand<'_>) -> Strided<'_> {
        let (row_stride, col_stride) = o.strides();
        Strided {
            data: o.data,
            rows: o.rows,
            cols: o.cols,
            row_stride: row_stride as usize,
            col_stride: col_stride as usize,
        }
    }
    assert!(
        c.len() >= a.rows * b.cols,
        "c holds {} < {}x{}",
        c.len(),
        a.rows,
        b.cols
    );
    gemm_strided(strided(a), strided(b), 1.0, beta, c, b.cols);
}

/// A matrix operand with any strides: element `(i, j)` is
/// `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy)]
pub struct Strided<'a> {
    /// The elements the strides reach.
    pub data: &'a [f32],
    /// Rows as used in the product.
    pub rows: usize,
    /// Columns as used in the product.
    pub cols: usize,
    /// Elements between rows.
    pub row_stride: usize,
    /// Elements between columns.
    pub col_stride: usize,
}

impl Strided<'_> {
    /// One past the last element the strides reach.
    fn reach(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride + 1
        }
    }
}

/// `c = alpha * a * b + beta * c`, with `c` `a.rows x b.cols` at row
/// stride `c_row_stride`.
pub fn gemm_strided(
    a: Strided<'_>,
    b: Strided<'_>,
    alpha: f32,
    beta: f32,
    c: &mut [f32],
    c_row_stride: usize,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert!(
        a.data.len() >= a.reach(),
        "a holds {} < {}",
        a.data.len(),
        a.reach()
    );
    assert!(
        b.data.len() >= b.reach(),
        "b holds {} < {}",
        b.data.len(),
        b.reach()
    );
    let c_reach = Strided {
        data: c,
        rows: m,
        cols: n,
        row_stride: c_row_stride,
        col_stride: 1,
    }
    .reach();
    assert!(c.len() >= c_reach, "c holds {} < {c_reach}", c.len());
    assert!(c_row_stride >= n || m <= 1, "c rows overlap");
    if m == 0 || n == 0 {
        return;
    }
    // The asserts above bound every index the strides reach in `a`, `b`
    // and `c`, and rows of `c` do not overlap.
    // SAFETY: in bounds (above); `c` is exclusive, aliasing neither `a` nor `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.row_stride as isize,
            a.col_stride as isize,
            b.data.as_ptr(),
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c.as_mut_ptr(),
            c_row_stride as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar reference.
    fn reference(a: Operand<'_>, b: Operand<'_>) -> Vec<f32> {
        let at = |o: &Operand<'_>, i: usize, j: usize| {
            if o.transposed {
                o.data[j * o.rows + i]
            } else {
                o.data[i * o.cols + j]
            }
        };
        let mut c = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                c[i * b.cols + j] = (0..a.cols).map(|p| at(&a, i, p) * at(&b, p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn every_transpose_matches_the_reference() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.91).cos()).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let oa = Operand {
                data: &a,
                rows: m,
                cols: k,
                transposed: ta,
            };
            let ob = Operand {
                data: &b,
                rows: k,
                cols: n,
                transposed: tb,
            };
            let mut c = vec![1.0; m * n];
            gemm(oa, ob, 0.0, &mut c);
            let want = reference(oa, ob);
            for (x, y) in c.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{ta} {tb}: {x} vs {y}");
            }
            gemm(oa, ob, 1.0, &mut c);
            for (x, y) in c.iter().zip(&want) {
                assert!((x - 2.0 * y).abs() < 1e-5);
            }
        }
    }
}
