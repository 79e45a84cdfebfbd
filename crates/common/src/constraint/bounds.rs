//! Bounds on the JSON numbers a schema leaves open, so that every answer can end.
//!
//! An unbounded JSON integer is a path through the grammar that never has to end: once a model
//! would rather write another key than close the object, and `additionalProperties: false`
//! forbids that, digits are all the grammar leaves it, and a small model writes them until
//! `max_tokens` runs out. So, unless the schema bounds it itself:
//! - an `integer` lies within ±[`INTEGER_LIMIT`]: an int64, at most 19 digits and a sign;
//! - a `number` is a plain decimal within ±[`NUMBER_LIMIT`] (the integers an f64 holds exactly)
//!   with at most 10 fraction digits ([`FRACTION_STEP`]), and no exponent.
//!
//! The bounds are schema keywords (`minimum`, `maximum`, `multipleOf`) that llguidance compiles
//! into its own number lexemes, so the grammar stays llguidance's. A schema's own bound is kept
//! as written, wider ones included, except one llguidance cannot represent (its ranges are i64,
//! read through an f64): that side is left open rather than silently clamped to the int64 range,
//! which would refuse the very values the schema asked for. Subschemas with `enum` or `const`
//! are already finite and left alone.

use serde_json::{Map, Value, json};

use super::subschemas_mut;

/// The bound of an unbounded `integer`: 2^63 - 1024, the largest f64 below 2^63. llguidance reads
/// bounds as f64 and negates the lower one as an i64, so -(2^63) would overflow.
const INTEGER_LIMIT: i64 = 9_223_372_036_854_774_784;
/// The bound of an unbounded `number`: 2^53 - 1, the largest integer with every smaller one
/// exact in an f64.
const NUMBER_LIMIT: i64 = 9_007_199_254_740_991;
/// The `multipleOf` step of an unbounded `number`, so at most 10 fraction digits: llguidance's
/// `multipleOf` arithmetic is exact down to 1e-10 (a smaller step does not survive its
/// conversion to a decimal).
const FRACTION_STEP: f64 = 1e-10;

/// Bound every `integer` and `number` subschema of `schema` that has no bound of its own.
pub fn bound_numbers(schema: &mut Value) {
    if let Value::Object(map) = schema {
        bound_one(map);
    }
    for child in subschemas_mut(schema) {
        bound_numbers(child);
    }
}

/// The schema of `response_format: json_object` with its values bounded: an object whose values,
/// at any depth, are JSON values with bounded numbers.
pub fn bounded_object() -> Value {
    let mut value = json!({
        "type": ["null", "boolean", "number", "string", "array", "object"],
        "items": {"$ref": "#/$defs/value"},
        "additionalProperties": {"$ref": "#/$defs/value"},
    });
    bound_numbers(&mut value);
    json!({"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}, "$defs": {"value": value}})
}

fn bound_one(map: &mut Map<String, Value>) {
    if map.contains_key("enum") || map.contains_key("const") {
        return;
    }
    let (limit, fraction) = if has_type(map, "number") {
        (NUMBER_LIMIT, true)
    } else if has_type(map, "integer") {
        (INTEGER_LIMIT, false)
    } else {
        return;
    };
    let representable = |v: &Value| v.as_f64().is_some_and(|b| b.abs() <= INTEGER_LIMIT as f64);
    let mut own = [None, None];
    for (side, keys) in [["minimum", "exclusiveMinimum"], ["maximum", "exclusiveMaximum"]].iter().enumerate() {
        for key in keys {
            match map.get(*key) {
                Some(v) if representable(v) => own[side] = own[side].or(v.as_f64()),
                // Left open (see the module docs): recorded as an own bound of infinite reach.
                Some(_) => {
                    map.remove(*key);
                    own[side] = Some(if side == 0 { f64::NEG_INFINITY } else { f64::INFINITY });
                }
                None => {}
            }
        }
    }
    // A side without a bound of its own gets the default, widened to the other side's bound so
    // that the range stays non-empty.
    let [lower, upper] = own;
    if lower.is_none() {
        let widened = upper.is_some_and(|u| u < -(limit as f64));
        map.insert("minimum".into(), json!(if widened { -INTEGER_LIMIT } else { -limit }));
    }
    if upper.is_none() {
        let widened = lower.is_some_and(|l| l > limit as f64);
        map.insert("maximum".into(), json!(if widened { INTEGER_LIMIT } else { limit }));
    }
    if fraction {
        // A schema's own step bounds the fraction digits as well.
        map.entry("multipleOf").or_insert_with(|| json!(FRACTION_STEP));
    }
}

fn has_type(map: &Map<String, Value>, name: &str) -> bool {
    match map.get("type") {
        Some(Value::String(t)) => t == name,
        Some(Value::Array(ts)) => ts.iter().any(|t| t == name),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::constraint::{Constraint, JsonBounds, accepts};

    fn bounded(schema: Value) -> Constraint {
        let c = Constraint::json_schema(schema, JsonBounds::Bounded);
        assert_eq!(c.check(), Ok(()), "{c:?}");
        c
    }

    #[test]
    fn an_integer_without_bounds_fits_an_int64() {
        let c = bounded(json!({"type": "integer"}));
        for ok in ["0", "-7", "9223372036854774784", "-9223372036854774784", "1234567890123456789"] {
            assert!(accepts(&c, ok), "{ok}");
        }
        for too_long in ["12345678901234567890", "9223372036854775808", "-99999999999999999999"] {
            assert!(!accepts(&c, too_long), "{too_long}");
        }
        let open = Constraint::json_schema(json!({"type": "integer"}), JsonBounds::Unbounded);
        assert!(accepts(&open, "12345678901234567890123"), "the opt-out leaves integers unbounded");
    }

    #[test]
    fn a_number_without_bounds_is_a_plain_decimal_of_bounded_length() {
        let c = bounded(json!({"type": "number"}));
        for ok in ["0", "-1.5", "3.1415926535", "9007199254740991", "-9007199254740990.0000000001"] {
            assert!(accepts(&c, ok), "{ok}");
        }
        for too_long in ["3.14159265358", "9007199254740992", "1e5", "2.5E-3", "1.50000000000000"] {
            assert!(!accepts(&c, too_long), "{too_long}");
        }
    }

    #[test]
    fn a_schemas_own_bounds_apply_as_written_wider_ones_included() {
        let c = bounded(json!({"type": "integer", "minimum": 3, "maximum": 10}));
        assert!(accepts(&c, "10") && !accepts(&c, "11") && !accepts(&c, "2"));
        let c = bounded(json!({"type": "integer", "minimum": 0}));
        assert!(accepts(&c, "9223372036854774784") && !accepts(&c, "-1") && !accepts(&c, "92233720368547747840"));
        // Beyond what llguidance's i64 ranges hold: the side is left open, not clamped to int64.
        let c = bounded(json!({"type": "integer", "maximum": 1e30}));
        assert!(accepts(&c, "100000000000000000000000"), "a value past int64 the schema allows");
        assert!(!accepts(&c, "-99999999999999999999"), "the side without a bound of its own is bounded");
        let c = bounded(json!({"type": "number", "maximum": 1e30}));
        assert!(accepts(&c, "100000000000000000000000.5"));
        let c = bounded(json!({"type": "number", "minimum": 1e17}));
        assert!(accepts(&c, "100000000000000000") && !accepts(&c, "99"), "the default side widens to keep the range");
        let c = bounded(json!({"type": "number", "multipleOf": 0.5}));
        assert!(accepts(&c, "2.5") && !accepts(&c, "2.25"), "a schema's own step");
    }

    #[test]
    fn numbers_are_bounded_at_any_depth_and_finite_subschemas_are_left_alone() {
        let c = bounded(json!({
            "$defs": {"n": {"type": "integer"}},
            "type": "object",
            "properties": {
                "list": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2},
                "either": {"anyOf": [{"type": ["number", "null"]}, {"type": "boolean"}]},
                "pick": {"type": "number", "enum": [0.123456789012]},
            },
            "required": ["list", "either"],
            "additionalProperties": false,
        }));
        assert!(accepts(&c, r#"{"list": [1, 2], "either": null}"#));
        assert!(!accepts(&c, r#"{"list": [12345678901234567890], "either": null}"#));
        assert!(!accepts(&c, r#"{"list": [], "either": 1.12345678901}"#));
        assert!(accepts(&c, r#"{"list": [], "either": true, "pick": 0.123456789012}"#), "an enum is kept");
    }

    #[test]
    fn a_json_object_bounds_its_numbers_at_any_depth() {
        let c = Constraint::json_object(JsonBounds::Bounded);
        assert_eq!(c.check(), Ok(()));
        assert!(accepts(&c, r#"{"a": [1, {"b": -2.5, "c": null}], "d": "x", "e": true}"#));
        assert!(!accepts(&c, r#"{"a": [12345678901234567890]}"#));
        assert!(!accepts(&c, r#"{"a": {"b": 1e5}}"#));
        assert!(!accepts(&c, "[1]"), "still an object at the root");
        assert!(accepts(&Constraint::json_object(JsonBounds::Unbounded), r#"{"a": 12345678901234567890}"#));
    }
}
