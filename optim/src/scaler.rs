//! Dynamic loss scaling for fp16 training: the loss is multiplied by a
//! scale before backward so small gradients survive fp16; a step whose
//! gradients overflowed is skipped and the scale backs off; after
//! `growth_interval` clean steps it grows again. PyTorch's GradScaler rule,
//! with DeepSpeed's `hysteresis` (overflows tolerated before backing off)
//! and `min_scale`.

use crate::OptimError;
use crate::adam::check;

/// Loss-scaler settings (PyTorch's defaults; `hysteresis = 1` is PyTorch's
/// behavior, DeepSpeed defaults to 2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerConfig {
    /// The first scale.
    pub init_scale: f32,
    /// Multiplier after `growth_interval` clean steps.
    pub growth_factor: f32,
    /// Multiplier after an overflow.
    pub backoff_factor: f32,
    /// Clean steps between growths.
    pub growth_interval: u32,
    /// Overflows in a row before the scale backs off.
    pub hysteresis: u32,
    /// The scale never falls below this.
    pub min_scale: f32,
}

impl Default for LossScalerConfig {
    fn default() -> LossScalerConfig {
        LossScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: 1.0,
        }
    }
}

/// The scale's state across steps.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    config: LossScalerConfig,
    scale: f32,
    clean_steps: u32,
    overflows_left: u32,
}

impl LossScaler {
    /// A scaler at `config.init_scale`, after checking the settings.
    pub fn new(config: LossScalerConfig) -> Result<LossScaler, OptimError> {
        let c = config;
        // The gradients are multiplied by 1 / scale: it must be finite.
        let invertible = |scale: f32| scale > 0.0 && (1.0 / scale).is_finite();
        check(
            "init_scale",
            c.init_scale.into(),
            invertible(c.init_scale),
            "finite and at least 1/f32::MAX (about 2.9e-39)",
        )?;
        check(
            "growth_factor",
            c.growth_factor.into(),
            c.growth_factor >= 1.0,
            "finite and >= 1",
        )?;
        let backoff = f64::from(c.backoff_factor);
        check(
            "backoff_factor",
            backoff,
            c.backoff_factor > 0.0 && c.backoff_factor < 1.0,
            "in (0, 1)",
        )?;
        check(
            "growth_interval",
            c.growth_interval.into(),
            c.growth_interval >= 1,
            ">= 1",
        )?;
        check("hysteresis", c.hysteresis.into(), c.hysteresis >= 1, ">= 1")?;
        check(
            "min_scale",
            c.min_scale.into(),
            invertible(c.min_scale) && c.min_scale <= c.init_scale,
            "in [1/f32::MAX, init_scale]",
        )?;
        Ok(LossScaler {
            config,
            scale: config.init_scale,
            clean_steps: 0,
            overflows_left: config.hysteresis,
        })
    }

    /// What a checkpoint keeps: the scale, clean steps since the last
    /// change, overflows left before backing off.
    pub fn state(&self) -> (f32, u32, u32) {
        (self.scale, self.clean_steps, self.overflows_left)
    }

    /// Restores [`LossScaler::state`] from a checkpoint onto a scaler made
    /// from the same settings.
    pub fn restore(
        &mut self,
        (scale, clean_steps, overflows_left): (f32, u32, u32),
    ) -> Result<(), OptimError> {
        check("scale", scale.into(), scale > 0.0, "finite and > 0")?;
        check(
            "clean_steps",
            clean_steps.into(),
            clean_steps < self.config.growth_interval,
            "below growth_interval",
        )?;
        check(
            "overflows_left",
            overflows_left.into(),
            (1..=self.config.hysteresis).contains(&overflows_left),
            "in [1, hysteresis]",
        )?;
        self.scale = scale;
        self.clean_steps = clean_steps;
        self.overflows_left = overflows_left;
        Ok(())
    }

    /// Multiply the loss by this before backward.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether the next overflow would back off from the smallest scale:
    /// gradients that overflow then are not finite at any scale this
    /// scaler may use (DeepSpeed stops such a run: "Current loss scale
    /// already at minimum").
    pub fn at_floor(&self) -> bool {
        self.overflows_left == 1 && self.scale <= self.config.min_scale
    }

    /// Records a step's outcome: `overflowed` when the gradients held NaN
    /// or infinity (the step was skipped).
    pub fn update(&mut self, overflowed: bool) {
        if overflowed {
            self.clean_steps = 0;
            self.overflows_left -= 1;
            if self.overflows_left == 0 {
                self.scale = (self.scale * self.config.backoff_factor).max(self.config.min_scale);
                self.overflows_left = self.config.hysteresis;
            }
            return;
        }
        self.clean_steps += 1;
        if self.clean_steps == self.config.growth_interval {
            self.clean_steps = 0;
            self.overflows_left = self.config.hysteresis;
            let grown = self.scale * self.config.growth_factor;
            if grown.is_finite() {
                self.scale = grown;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(hysteresis: u32) -> LossScaler {
        let config = LossScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            hysteresis,
            ..Default::default()
        };
        LossScaler::new(config).unwrap()
    }

    #[test]
    fn backs_off_on_overflow_and_grows_after_clean_steps() {
        let mut s = scaler(1);
        s.update(true);
        assert_eq!(s.scale(), 512.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
        s.update(false);
        assert_eq!(s.scale(), 1024.0);
        // An overflow resets the clean-step count.
        s.update(false);
        s.update(true);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
        s.update(false);
        assert_eq!(s.scale(), 1024.0);
    }

    #[test]
    fn hysteresis_tolerates_overflows_and_min_scale_holds() {
        let mut s = scaler(2);
        s.update(true);
        assert_eq!(s.scale(), 1024.0);
        s.update(true);
        assert_eq!(s.scale(), 512.0);
        for _ in 0..40 {
            s.update(true);
        }
        assert_eq!(s.scale(), 1.0);
    }

    #[test]
    fn bad_settings_are_named() {
        let bad = LossScalerConfig {
            backoff_factor: 1.5,
            ..Default::default()
        };
        let error = LossScaler::new(bad).unwrap_err().to_string();
        assert!(error.contains("backoff_factor = 1.5"), "{error}");
    }
}
