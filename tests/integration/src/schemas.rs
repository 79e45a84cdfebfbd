//! Generated JSON Schemas for structured-output tests, and the validator that checks outputs.
//!
//! Each schema is a pure function of its seed, so a failing case can be rerun alone. Every string
//! is bounded (a length, an enum, a pattern or a format) and every array too, so a generator that
//! picks among allowed tokens at random still finishes within a modest `max_tokens`.

use serde_json::{Map, Value, json};

/// A small deterministic generator (SplitMix64): tests need no `rand` to be reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Schema number `seed`: an object at the root (what `response_format` users send), nested up to
/// three levels, with enums, bounded arrays, optional fields, patterns and string formats.
pub fn schema(seed: u64) -> Value {
    let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5bd1_e995);
    object(&mut rng, 0)
}

fn object(rng: &mut Rng, depth: u32) -> Value {
    let n = 1 + rng.below(4);
    let mut properties = Map::new();
    let mut required = Vec::new();
    for i in 0..n {
        let name = format!("{}_{i}", ["id", "name", "tags", "score", "meta", "items", "ok"][rng.below(7) as usize]);
        properties.insert(name.clone(), value(rng, depth + 1));
        if rng.chance(70) {
            required.push(Value::String(name));
        }
    }
    json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false})
}

fn value(rng: &mut Rng, depth: u32) -> Value {
    let kinds = if depth >= 3 { 8 } else { 11 };
    match rng.below(kinds) {
        0 => json!({"type": "string", "minLength": rng.below(3), "maxLength": 3 + rng.below(10)}),
        1 => {
            let words = ["red", "green", "blue", "alpha", "beta", "x y", "q\"uote", "naïve"];
            let k = 2 + rng.below(4) as usize;
            let start = rng.below(words.len() as u64) as usize;
            let pick: Vec<&str> = (0..k).map(|i| words[(start + i) % words.len()]).collect();
            json!({"enum": pick})
        }
        2 => {
            let lo = -(rng.below(50) as i64);
            json!({"type": "integer", "minimum": lo, "maximum": lo + 1 + rng.below(1000) as i64})
        }
        3 => json!({"type": "number", "minimum": 0, "maximum": 1 + rng.below(100)}),
        4 => json!({"type": "boolean"}),
        5 => json!({"type": "string", "format": "uuid"}),
        6 => json!({"type": "string", "pattern": "^[a-z]{2,6}-[0-9]{1,3}$"}),
        7 => [json!({"type": "null"}), json!({"const": "fixed"}), json!({"type": ["integer", "null"], "maximum": 9})]
            [rng.below(3) as usize]
            .clone(),
        8 => object(rng, depth),
        9 => {
            let min = rng.below(2);
            json!({"type": "array", "items": value(rng, depth + 1), "minItems": min, "maxItems": min + 1 + rng.below(2)})
        }
        _ => json!({"anyOf": [value(rng, depth + 1), value(rng, depth + 1)]}),
    }
}

/// Short-answer schema number `seed`, for the test that every answer ends: an object of 2-4
/// required fields, none of them bounded by the schema: integers, numbers, booleans, enums,
/// nested objects and arrays with `maxItems` (no free strings, whose length is the model's to
/// choose). Its shortest valid answer is [`shortest`].
pub fn short_schema(seed: u64) -> Value {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491);
    short_object(&mut rng, 0)
}

fn short_object(rng: &mut Rng, depth: u32) -> Value {
    let n = 2 + rng.below(3);
    let mut properties = Map::new();
    for i in 0..n {
        let name = format!("{}_{i}", ["count", "price", "ok", "kind", "size", "year"][rng.below(6) as usize]);
        properties.insert(name, short_value(rng, depth + 1));
    }
    let required: Vec<Value> = properties.keys().cloned().map(Value::String).collect();
    json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false})
}

fn short_value(rng: &mut Rng, depth: u32) -> Value {
    let kinds = if depth >= 2 { 4 } else { 6 };
    match rng.below(kinds) {
        0 => json!({"type": "integer"}),
        1 => json!({"type": "number"}),
        2 => json!({"type": "boolean"}),
        3 => {
            let sets: [&[&str]; 3] = [&["small", "large"], &["red", "green", "blue"], &["yes", "no", "maybe"]];
            json!({"enum": sets[rng.below(3) as usize]})
        }
        4 => short_object(rng, depth),
        _ => {
            let item = [json!({"type": "integer"}), json!({"type": "number"}), json!({"type": "boolean"})]
                [rng.below(3) as usize]
                .clone();
            json!({"type": "array", "items": item, "minItems": rng.below(2), "maxItems": 2 + rng.below(3)})
        }
    }
}

/// The shortest valid answer to a [`short_schema`], laid out as structured outputs are.
pub fn shortest(schema: &Value) -> String {
    if let Some(choices) = schema["enum"].as_array() {
        return choices.iter().map(Value::to_string).min_by_key(String::len).unwrap();
    }
    match schema["type"].as_str() {
        Some("integer" | "number") => "0".into(),
        Some("boolean") => "true".into(),
        Some("array") => {
            let items = vec![shortest(&schema["items"]); schema["minItems"].as_u64().unwrap_or(0) as usize];
            format!("[{}]", items.join(", "))
        }
        Some("object") => {
            let fields: Vec<String> = schema["properties"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), shortest(v)))
                .collect();
            format!("{{{}}}", fields.join(", "))
        }
        other => panic!("not a short schema's type: {other:?}"),
    }
}

/// Check `instance` against `schema` with a JSON Schema validator (formats included).
pub fn validate(schema: &Value, instance: &Value) -> Result<(), String> {
    let validator = jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .map_err(|e| format!("the test's own schema does not compile: {e}"))?;
    let errors: Vec<String> =
        validator.iter_errors(instance).map(|e| format!("{} at {}", e, e.instance_path)).collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
}

/// Parse `text` as JSON and validate it: the check every structured-output test makes.
pub fn check_output(schema: &Value, text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    validate(schema, &v).map_err(|e| format!("{e}: {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_are_reproducible_varied_and_valid_json_schemas() {
        assert_eq!(schema(7), schema(7));
        let all: Vec<Value> = (0..200).map(schema).collect();
        let distinct: std::collections::HashSet<String> = all.iter().map(Value::to_string).collect();
        assert!(distinct.len() > 190, "only {} distinct schemas of 200", distinct.len());
        for (i, s) in all.iter().enumerate() {
            jsonschema::options().build(s).unwrap_or_else(|e| panic!("schema {i} does not compile: {e}"));
        }
        let text = all.iter().map(Value::to_string).collect::<String>();
        for feature in ["\"enum\"", "\"format\"", "\"pattern\"", "\"anyOf\"", "\"maxItems\"", "\"required\":[]"] {
            assert!(text.contains(feature), "no schema uses {feature}");
        }
    }

    #[test]
    fn the_shortest_answer_to_a_short_schema_is_valid_and_has_no_free_strings() {
        let all: Vec<Value> = (0..50).map(short_schema).collect();
        let text = all.iter().map(Value::to_string).collect::<String>();
        for feature in [
            "\"integer\"",
            "\"number\"",
            "\"boolean\"",
            "\"enum\"",
            "\"maxItems\"",
            "\"properties\":{\"",
            "\"minItems\":1",
        ] {
            assert!(text.contains(feature), "no short schema uses {feature}");
        }
        assert!(!text.contains("\"string\""), "a free string's length is the model's to choose");
        for (i, s) in all.iter().enumerate() {
            check_output(s, &shortest(s)).unwrap_or_else(|e| panic!("short schema {i}: {e}"));
        }
        let s = json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "b": {"enum": ["red", "no"]}}});
        assert_eq!(shortest(&s), r#"{"a": [0], "b": "no"}"#);
    }

    #[test]
    fn the_validator_refuses_what_the_schema_forbids() {
        let s = schema(3);
        assert!(validate(&s, &json!("not an object")).is_err());
        assert!(check_output(&json!({"type": "integer", "maximum": 3}), "4").is_err());
        assert!(check_output(&json!({"type": "integer", "maximum": 3}), "3").is_ok());
    }
}
