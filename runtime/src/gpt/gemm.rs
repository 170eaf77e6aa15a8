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
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert!(a.data.len() >= m * k, "a holds {} < {m}x{k}", a.data.len());
    assert!(b.data.len() >= k * n, "b holds {} < {k}x{n}", b.data.len());
    assert!(c.len() >= m * n, "c holds {} < {m}x{n}", c.len());
    if m == 0 || n == 0 {
        return;
    }
    let (rsa, csa) = a.strides();
    let (rsb, csb) = b.strides();
    // The asserts above bound every index the strides reach: below m*k in
    // `a`, k*n in `b` and m*n in `c`.
    // SAFETY: in bounds (above); `c` is exclusive, aliasing neither `a` nor `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            rsa,
            csa,
            b.data.as_ptr(),
            rsb,
            csb,
            beta,
            c.as_mut_ptr(),
            n as isize,
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
