//! Optimizers over a flat parameter vector: Adam(W) and L-BFGS, as ggml's first version offered
//! them. Both take an [`Objective`] (the loss and its gradient at a point: a forward and backward
//! graph run, or any function) and the caller's working memory; neither allocates.

/// A function to minimise.
pub trait Objective {
    /// Why an evaluation failed (stops the optimizer).
    type Error;
    /// The loss at `x`, with its gradient written to `grad` (as long as `x`).
    fn evaluate(&mut self, x: &[f32], grad: &mut [f32]) -> Result<f32, Self::Error>;
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The gradient or the change of the loss fell below the tolerance.
    Converged,
    /// The iterations ran out first.
    DidNotConverge,
    /// L-BFGS: no step along the search direction satisfied the line search's conditions.
    LineSearchFailed,
}

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// How it ended.
    pub outcome: Outcome,
    /// Iterations (parameter updates).
    pub iterations: usize,
    /// Loss evaluations.
    pub evaluations: usize,
    /// The loss at the final parameters.
    pub loss: f32,
}

/// Why an optimizer could not run.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimError<E> {
    /// The objective failed.
    Objective(E),
    /// The working memory is shorter than needed.
    WorkTooSmall {
        /// Floats needed.
        needed: usize,
        /// Floats given.
        got: usize,
    },
    /// A setting is out of its range.
    BadSetting(&'static str),
    /// The loss or gradient became NaN or infinite.
    NonFinite,
}

impl<E: core::fmt::Display> core::fmt::Display for OptimError<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Objective(e) => write!(f, "{e}"),
            Self::WorkTooSmall { needed, got } => {
                write!(f, "the optimizer needs {needed} floats of working memory, {got} given")
            }
            Self::BadSetting(what) => write!(f, "optimizer setting out of range: {what}"),
            Self::NonFinite => write!(f, "the loss or its gradient is NaN or infinite"),
        }
    }
}

/// The learning rate over a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// The same rate throughout.
    Constant,
    /// Linear warm-up over `warmup` iterations, then a cosine decay to `min_fraction` of the rate
    /// at the last iteration.
    Cosine {
        /// Warm-up iterations.
        warmup: usize,
        /// The final rate as a fraction of the peak.
        min_fraction: f32,
    },
}

impl Schedule {
    /// The rate factor at iteration `t` (0-based) of `total`.
    pub fn factor(self, t: usize, total: usize) -> f32 {
        match self {
            Self::Constant => 1.0,
            Self::Cosine { warmup, min_fraction } => {
                if t < warmup {
                    return (t + 1) as f32 / warmup as f32;
                }
                let span = total.saturating_sub(warmup).max(1);
                let progress = ((t - warmup) as f32 / span as f32).min(1.0);
                min_fraction
                    + (1.0 - min_fraction) * 0.5 * (1.0 + libm::cosf(core::f32::consts::PI * progress))
            }
        }
    }
}

/// Adam(W)'s settings (the defaults are Adam's paper's, with no decay or clipping).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adam {
    /// Peak learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the second moment's root.
    pub eps: f32,
    /// Decoupled weight decay (AdamW), per unit of learning rate; 0 = Adam.
    pub weight_decay: f32,
    /// Largest gradient norm (a larger gradient is scaled down to it); 0 = no clipping.
    pub clip_norm: f32,
    /// The learning rate over the run.
    pub schedule: Schedule,
    /// Most iterations.
    pub max_iterations: usize,
    /// Converged when the gradient's norm falls below this (0: never on the gradient).
    pub grad_tolerance: f32,
}

impl Default for Adam {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clip_norm: 0.0,
            schedule: Schedule::Constant,
            max_iterations: 1000,
            grad_tolerance: 1e-5,
        }
    }
}

impl Adam {
    /// Floats of working memory for `n` parameters (gradient and two moments).
    pub fn work_len(n: usize) -> usize {
        3 * n
    }

    /// Minimises `f` from `x` (updated in place); `on_iteration(t, loss)` after each evaluation.
    pub fn minimize<O: Objective>(
        &self,
        f: &mut O,
        x: &mut [f32],
        work: &mut [f32],
        on_iteration: &mut dyn FnMut(usize, f32),
    ) -> Result<Report, OptimError<O::Error>> {
        let n = x.len();
        let work = take_work(work, Self::work_len(n))?;
        if !(self.lr > 0.0
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps > 0.0)
        {
            return Err(OptimError::BadSetting("Adam needs lr > 0, 0 <= beta1, beta2 < 1, eps > 0"));
        }
        let (g, rest) = work.split_at_mut(n);
        let (m, v) = rest.split_at_mut(n);
        m.fill(0.0);
        v.fill(0.0);
        for t in 0..self.max_iterations {
            let loss = f.evaluate(x, g).map_err(OptimError::Objective)?;
            on_iteration(t, loss);
            let norm = norm(g);
            if !loss.is_finite() || !norm.is_finite() {
                return Err(OptimError::NonFinite);
            }
            if norm < self.grad_tolerance {
                return Ok(Report { outcome: Outcome::Converged, iterations: t, evaluations: t + 1, loss });
            }
            self.update(t, self.max_iterations, x, g, m, v);
        }
        let loss = f.evaluate(x, g).map_err(OptimError::Objective)?;
        let outcome =
            if norm(g) < self.grad_tolerance { Outcome::Converged } else { Outcome::DidNotConverge };
        Ok(Report { outcome, iterations: self.max_iterations, evaluations: self.max_iterations + 1, loss })
    }
}

impl Adam {
    /// One update of `x` by gradient `g` at step `t` (0-based) of `total` (the schedule's length),
    /// with the moments `m` and `v` (zeros before the first step; kept between steps): for
    /// training loops that change the objective every step (a new batch), where
    /// [`Adam::minimize`] holds one objective. Clips, schedules and decays as configured.
    pub fn update(&self, t: usize, total: usize, x: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let norm = norm(g);
        let clip = if self.clip_norm > 0.0 && norm > self.clip_norm { self.clip_norm / norm } else { 1.0 };
        let lr = self.lr * self.schedule.factor(t, total);
        let step = (t + 1) as i32;
        let (c1, c2) = (1.0 - libm::powf(self.beta1, step as f32), 1.0 - libm::powf(self.beta2, step as f32));
        for i in 0..x.len().min(g.len()).min(m.len()).min(v.len()) {
            let gi = g[i] * clip;
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
            let (mh, vh) = (m[i] / c1, v[i] / c2);
            x[i] -= lr * (mh / (libm::sqrtf(vh) + self.eps) + self.weight_decay * x[i]);
        }
    }
}

/// The conditions an L-BFGS step must meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineSearch {
    /// Sufficient decrease only (backtracking).
    Armijo,
    /// Sufficient decrease and the (weak) curvature condition.
    Wolfe,
    /// Sufficient decrease and the strong curvature condition.
    StrongWolfe,
}

/// L-BFGS's settings (ggml's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lbfgs {
    /// Corrections kept (the history), at most [`Lbfgs::MAX_HISTORY`].
    pub history: usize,
    /// Converged when `|g| / max(1, |x|)` falls below this.
    pub grad_tolerance: f32,
    /// Converged when the loss changed by less than this fraction over `past` iterations (0: off).
    pub delta: f32,
    /// Iterations the `delta` test looks back.
    pub past: usize,
    /// Most iterations.
    pub max_iterations: usize,
    /// The line search's conditions.
    pub line_search: LineSearch,
    /// Most trial steps per line search.
    pub max_line_search: usize,
    /// Sufficient decrease constant (Armijo's c1).
    pub ftol: f32,
    /// Curvature constant (Wolfe's c2).
    pub wolfe: f32,
    /// Smallest and largest step.
    pub min_step: f32,
    /// Largest step.
    pub max_step: f32,
}

impl Default for Lbfgs {
    fn default() -> Self {
        Self {
            history: 6,
            grad_tolerance: 1e-5,
            delta: 1e-5,
            past: 3,
            max_iterations: 100,
            line_search: LineSearch::Wolfe,
            max_line_search: 20,
            ftol: 1e-4,
            wolfe: 0.9,
            min_step: 1e-20,
            max_step: 1e20,
        }
    }
}

impl Lbfgs {
    /// The longest history [`Lbfgs::history`] may ask for.
    pub const MAX_HISTORY: usize = 32;

    /// Floats of working memory for `n` parameters.
    pub fn work_len(&self, n: usize) -> usize {
        n * (2 * self.history + 4)
    }

    /// Minimises `f` from `x` (updated in place); `on_iteration(k, loss)` after each iteration.
    pub fn minimize<O: Objective>(
        &self,
        f: &mut O,
        x: &mut [f32],
        work: &mut [f32],
        on_iteration: &mut dyn FnMut(usize, f32),
    ) -> Result<Report, OptimError<O::Error>> {
        let n = x.len();
        let m = self.history;
        if m == 0 || m > Self::MAX_HISTORY {
            return Err(OptimError::BadSetting("the L-BFGS history must be 1..=32"));
        }
        if !(0.0 < self.ftol && self.ftol < self.wolfe && self.wolfe < 1.0) {
            return Err(OptimError::BadSetting("L-BFGS needs 0 < ftol < wolfe < 1"));
        }
        let work = take_work(work, self.work_len(n))?;
        let (s, rest) = work.split_at_mut(m * n);
        let (y, rest) = rest.split_at_mut(m * n);
        let (g, rest) = rest.split_at_mut(n);
        let (d, rest) = rest.split_at_mut(n);
        let (xp, rest) = rest.split_at_mut(n);
        let gp = &mut rest[..n];
        let mut rho = [0f32; Self::MAX_HISTORY];
        let mut alpha = [0f32; Self::MAX_HISTORY];
        let mut past_losses = [0f32; 64];
        let past = self.past.min(past_losses.len());

        let mut evaluations = 1;
        let mut loss = f.evaluate(x, g).map_err(OptimError::Objective)?;
        if !loss.is_finite() {
            return Err(OptimError::NonFinite);
        }
        if norm(g) / norm(x).max(1.0) <= self.grad_tolerance {
            return Ok(Report { outcome: Outcome::Converged, iterations: 0, evaluations, loss });
        }
        // The first direction: steepest descent, with a step of 1 / |g|.
        for i in 0..n {
            d[i] = -g[i];
        }
        let mut step = 1.0 / norm(d);
        let (mut k, mut end) = (0usize, 0usize);
        loop {
            xp.copy_from_slice(x);
            gp.copy_from_slice(g);
            if !self.line_search(f, x, g, d, xp, &mut loss, &mut step, &mut evaluations)? {
                // Back to the last good point (a failed search leaves `loss` at its value).
                x.copy_from_slice(xp);
                return Ok(Report { outcome: Outcome::LineSearchFailed, iterations: k, evaluations, loss });
            }
            on_iteration(k, loss);
            k += 1;
            if norm(g) / norm(x).max(1.0) <= self.grad_tolerance {
                return Ok(Report { outcome: Outcome::Converged, iterations: k, evaluations, loss });
            }
            if self.delta > 0.0 && past > 0 {
                if k > past {
                    let before = past_losses[k % past];
                    if (before - loss).abs() / loss.abs().max(f32::MIN_POSITIVE) < self.delta {
                        return Ok(Report { outcome: Outcome::Converged, iterations: k, evaluations, loss });
                    }
                }
                past_losses[k % past] = loss;
            }
            if k >= self.max_iterations {
                return Ok(Report { outcome: Outcome::DidNotConverge, iterations: k, evaluations, loss });
            }
            // The new correction pair: s = x - x_prev, y = g - g_prev.
            let (sk, yk) = (&mut s[end * n..(end + 1) * n], &mut y[end * n..(end + 1) * n]);
            for i in 0..n {
                sk[i] = x[i] - xp[i];
                yk[i] = g[i] - gp[i];
            }
            let ys = dot(yk, sk);
            let yy = dot(yk, yk);
            rho[end] = 1.0 / ys;
            let bound = k.min(m);
            end = (end + 1) % m;
            // Two-loop recursion: d = -H g.
            for i in 0..n {
                d[i] = -g[i];
            }
            let mut j = end;
            for _ in 0..bound {
                j = (j + m - 1) % m;
                alpha[j] = rho[j] * dot(&s[j * n..(j + 1) * n], d);
                axpy(-alpha[j], &y[j * n..(j + 1) * n], d);
            }
            let scale = ys / yy;
            d.iter_mut().for_each(|v| *v *= scale);
            for _ in 0..bound {
                let beta = rho[j] * dot(&y[j * n..(j + 1) * n], d);
                axpy(alpha[j] - beta, &s[j * n..(j + 1) * n], d);
                j = (j + 1) % m;
            }
            step = 1.0;
        }
    }

    /// Backtracking along `d` from `xp` (loss `*loss`, gradient `g` on entry): halves the step
    /// while the sufficient decrease fails, grows it (x2.1) while the curvature condition fails.
    /// On success `x`, `g`, `*loss` are the accepted point's.
    #[allow(clippy::too_many_arguments)]
    fn line_search<O: Objective>(
        &self,
        f: &mut O,
        x: &mut [f32],
        g: &mut [f32],
        d: &[f32],
        xp: &[f32],
        loss: &mut f32,
        step: &mut f32,
        evaluations: &mut usize,
    ) -> Result<bool, OptimError<O::Error>> {
        let f0 = *loss;
        let dg0 = dot(g, d);
        if dg0 >= 0.0 {
            return Ok(false); // not a descent direction
        }
        for _ in 0..self.max_line_search {
            if !(*step >= self.min_step && *step <= self.max_step) {
                return Ok(false);
            }
            for i in 0..x.len() {
                x[i] = xp[i] + *step * d[i];
            }
            let fx = f.evaluate(x, g).map_err(OptimError::Objective)?;
            *evaluations += 1;
            if !fx.is_finite() || fx > f0 + self.ftol * *step * dg0 {
                *step *= 0.5;
                continue;
            }
            let dg = dot(g, d);
            let accept = match self.line_search {
                LineSearch::Armijo => true,
                LineSearch::Wolfe => dg >= self.wolfe * dg0,
                LineSearch::StrongWolfe => dg.abs() <= -self.wolfe * dg0,
            };
            if accept {
                *loss = fx;
                return Ok(true);
            }
            if self.line_search == LineSearch::StrongWolfe && dg > -self.wolfe * dg0 {
                *step *= 0.5;
            } else {
                *step *= 2.1;
            }
        }
        Ok(false)
    }
}

/// The first `needed` floats of the caller's working memory.
fn take_work<E>(work: &mut [f32], needed: usize) -> Result<&mut [f32], OptimError<E>> {
    let got = work.len();
    work.get_mut(..needed).ok_or(OptimError::WorkTooSmall { needed, got })
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>() as f32
}

fn norm(a: &[f32]) -> f32 {
    libm::sqrtf(dot(a, a))
}

fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(yi, &xi)| *yi += a * xi);
}
