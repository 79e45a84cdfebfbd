//! Unknown JSON Schema keywords are refused, not ignored.
//!
//! llguidance refuses a keyword of the JSON Schema vocabulary that it does not implement
//! (`uniqueItems`), but silently skips one outside the vocabulary: a misspelled `maxLenght` would
//! leave the string unbounded while the user believes it bounded. So every keyword of every
//! subschema must be one llguidance compiles, an annotation, or a vocabulary keyword it reports
//! itself. A schema whose root sets llguidance's own `"x-guidance": {"lenient": true}` opts out:
//! then unknown and unimplemented keywords are both ignored.

use serde_json::Value;

use super::{SchemaError, subschemas};

/// Keywords llguidance compiles.
const COMPILED: [&str; 27] = [
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "const",
    "enum",
    "type",
    "items",
    "additionalItems",
    "prefixItems",
    "minItems",
    "maxItems",
    "properties",
    "additionalProperties",
    "patternProperties",
    "required",
    "minProperties",
    "maxProperties",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];

/// Annotations and identifiers: they describe and do not constrain. `discriminator` is
/// OpenAPI's, which Pydantic writes beside a tagged `oneOf`.
const ANNOTATIONS: [&str; 18] = [
    "$anchor",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "id",
    "$comment",
    "title",
    "description",
    "default",
    "readOnly",
    "writeOnly",
    "examples",
    "contentMediaType",
    "contentEncoding",
    "deprecated",
    "discriminator",
    "x-guidance",
];

/// The rest of the 2020-12 vocabulary (and draft 7's names): llguidance refuses these itself,
/// naming them as unimplemented.
const UNIMPLEMENTED: [&str; 19] = [
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contentSchema",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
];

/// A keyword is known when it is in the vocabulary or is an extension (`x-` prefixed).
fn known(keyword: &str) -> bool {
    keyword.starts_with("x-")
        || COMPILED.contains(&keyword)
        || ANNOTATIONS.contains(&keyword)
        || UNIMPLEMENTED.contains(&keyword)
        || keyword == "$vocabulary"
}

/// Whether the schema's root asks for llguidance's lenient mode.
fn lenient(schema: &Value) -> bool {
    schema.pointer("/x-guidance/lenient") == Some(&Value::Bool(true))
}

/// The first unknown keyword of `schema` or its subschemas, as a refusal naming it and the
/// pointer of the subschema that holds it; `None` when every keyword is known or the schema is
/// lenient.
pub(super) fn refuse_unknown(schema: &Value) -> Option<SchemaError> {
    if lenient(schema) {
        return None;
    }
    let (pointer, keyword) = first_unknown(schema, String::new())?;
    Some(SchemaError {
        message: format!(
            "Unknown keyword '{keyword}': not a JSON Schema keyword (a schema whose root sets \
             \"x-guidance\": {{\"lenient\": true}} ignores unknown keywords)"
        ),
        pointer: (!pointer.is_empty()).then_some(pointer),
    })
}

fn first_unknown(schema: &Value, at: String) -> Option<(String, String)> {
    let Value::Object(map) = schema else { return None };
    if let Some(keyword) = map.keys().find(|k| !known(k)) {
        return Some((at, keyword.clone()));
    }
    subschemas(schema).into_iter().find_map(|(path, sub)| first_unknown(sub, format!("{at}{path}")))
}
