//! OpenAI's `strict: true` on a JSON Schema (`response_format`, `text.format`, a function's
//! `parameters`): every object lists all its properties in `required` and sets
//! `additionalProperties: false`, so an answer has exactly the keys the schema names, no more
//! and none left out.
//!
//! A strict schema that breaks those rules is refused, naming the place, as OpenAI refuses it.
//! Applying the rules instead would quietly make optional fields required, or drop keys a user
//! allowed; and passing the schema through as it is lets the model add keys the client's strict
//! parser (the SDKs' `parse`) then rejects.

use serde_json::Value;

/// Check `schema` against the strict rules: the first breach, as a message naming its JSON
/// pointer.
pub fn check(schema: &Value) -> Result<(), String> {
    walk(schema, "")
}

fn walk(v: &Value, at: &str) -> Result<(), String> {
    let Value::Object(o) = v else { return Ok(()) };
    let properties = o.get("properties").and_then(Value::as_object);
    let is_object = properties.is_some() || o.get("type").and_then(Value::as_str) == Some("object");
    if is_object {
        let place = if at.is_empty() { "the schema's root" } else { at };
        if o.get("additionalProperties") != Some(&Value::Bool(false)) {
            return Err(format!("a strict schema needs 'additionalProperties': false on every object ({place})"));
        }
        let required: Vec<&str> = o
            .get("required")
            .and_then(Value::as_array)
            .map_or(Vec::new(), |r| r.iter().filter_map(Value::as_str).collect());
        if let Some(missing) = properties.into_iter().flat_map(|p| p.keys()).find(|k| !required.contains(&k.as_str())) {
            return Err(format!("a strict schema lists every property in 'required': {missing:?} is not ({place})"));
        }
    }
    for (key, sub) in o {
        match (key.as_str(), sub) {
            ("properties" | "$defs" | "definitions", Value::Object(map)) => {
                for (name, s) in map {
                    walk(s, &format!("{at}/{key}/{}", escape(name)))?;
                }
            }
            ("items" | "additionalProperties" | "not" | "if" | "then" | "else", s) if s.is_object() => {
                walk(s, &format!("{at}/{key}"))?;
            }
            ("items" | "prefixItems" | "anyOf" | "oneOf" | "allOf", Value::Array(list)) => {
                for (i, s) in list.iter().enumerate() {
                    walk(s, &format!("{at}/{key}/{i}"))?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A key as a JSON pointer spells it.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_schema_as_the_sdks_write_strict_ones_passes() {
        let city = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}},
                "where": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"], "additionalProperties": false}]},
            },
            "required": ["name", "tags", "where"],
            "additionalProperties": false,
            "$defs": {"Tag": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"], "additionalProperties": false}},
        });
        assert_eq!(check(&city), Ok(()));
        assert_eq!(check(&json!({"type": "string"})), Ok(()), "no object, nothing to close");
    }

    #[test]
    fn an_open_object_or_an_optional_property_is_named_at_its_pointer() {
        let open = json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]});
        assert!(check(&open).unwrap_err().contains("the schema's root"));
        let optional = json!({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "additionalProperties": false});
        assert!(check(&optional).unwrap_err().contains("\"b\" is not"));
        let deep = json!({
            "type": "object", "required": ["list"], "additionalProperties": false,
            "properties": {"list": {"type": "array", "items": {"type": "object", "properties": {"x/y": {}}, "additionalProperties": false}}},
        });
        assert!(check(&deep).unwrap_err().contains("(/properties/list/items)"), "{:?}", check(&deep));
        let in_defs = json!({"$defs": {"T": {"type": "object"}}, "type": "string"});
        assert!(check(&in_defs).unwrap_err().contains("/$defs/T"));
    }
}
