//! Structured-output constraints: what a request may require its output to match, and the one
//! compile check that router and worker share.
//!
//! The router refuses a constraint before any worker is used, so it must refuse exactly what a
//! worker could not compile: both sides turn a [`Constraint`] into the same llguidance grammar
//! ([`Constraint::grammar`]) under the same [`limits`]. The router compiles against a byte-level
//! vocabulary (the grammar's validity does not depend on the model's tokens), the worker against
//! its model's token bytes. The limits bound compile and per-token work by "fuel", not by a
//! clock, so a grammar too large or too slow to build is refused the same way on every machine
//! instead of being left to hang a worker.

mod bounds;
mod keywords;

use std::sync::{Arc, LazyLock};

use llguidance::{
    ParserFactory,
    api::{ParserLimits, TopLevelGrammar},
    toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie},
};
use serde_json::Value;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object: OpenAI's `response_format: {"type": "json_object"}`.
    JsonObject,
    /// A JSON Schema: OpenAI's `response_format: {"type": "json_schema"}`.
    JsonSchema(Value),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// A context-free grammar in llguidance's Lark dialect.
    Lark(String),
}

/// The first line of a Lark grammar that [`Constraint::after_thinking`] may nest: its start is
/// a rule named `answer`, and it names no rule `thinking` or `GAP`.
pub const NESTABLE_START: &str = "start: answer\n";

/// Whether a request's JSON numbers get the default bounds (docs/structured-outputs.md): an
/// integer within int64, a number a plain decimal of bounded length. Users who need wider values
/// than their schema says turn them off per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonBounds {
    Bounded,
    Unbounded,
}

impl JsonBounds {
    /// `schema` with its numbers bounded as this says.
    pub fn apply(self, mut schema: Value) -> Value {
        if self == JsonBounds::Bounded {
            bounds::bound_numbers(&mut schema);
        }
        schema
    }
}

/// Why a constraint cannot be used. The message is the constraint engine's own, which names the
/// offending keyword or rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// A refused JSON Schema: the engine's message and, when it can be found, the JSON pointer of
/// the deepest subschema that fails on its own with the same message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    pub message: String,
    pub pointer: Option<String>,
}

/// Compile and per-step limits, the same in router and worker. Tighter than llguidance's
/// defaults on grammar size (a gateway serves untrusted schemas), the same elsewhere.
pub fn limits() -> ParserLimits {
    ParserLimits { max_grammar_size: 200_000, verbose_errors: false, ..ParserLimits::default() }
}

impl Constraint {
    /// A JSON Schema constraint, its numbers bounded as `bounds` says.
    pub fn json_schema(schema: Value, bounds: JsonBounds) -> Constraint {
        Constraint::JsonSchema(bounds.apply(schema))
    }

    /// Any JSON object, its numbers (at any depth) bounded as `bounds` says.
    pub fn json_object(bounds: JsonBounds) -> Constraint {
        match bounds {
            JsonBounds::Bounded => Constraint::JsonSchema(bounds::bounded_object()),
            JsonBounds::Unbounded => Constraint::JsonObject,
        }
    }

    /// This constraint on the answer of a model that thinks first: its thinking free text up
    /// to the close tag `</think>`, then whitespace, then what `self` allows. Without it a
    /// thinking model under a JSON Schema would have to answer in JSON from its first token,
    /// never closing its thinking (so its whole answer would read as thinking). A grammar nests
    /// only when it opens with [`NESTABLE_START`] (as the router's tool-call grammars do): a
    /// client's own grammar is not ours to rewrite, and gets `None`.
    pub fn after_thinking(&self) -> Option<Constraint> {
        let answer = match self {
            Constraint::JsonObject => format!("answer: %json {}\n", compact(&serde_json::json!({"type": "object"}))),
            Constraint::JsonSchema(schema) => format!("answer: %json {}\n", compact(schema)),
            Constraint::Regex(rx) => format!("answer: /{}/\n", llguidance::regex_to_lark(rx, "")),
            Constraint::Lark(grammar) => grammar.strip_prefix(NESTABLE_START)?.to_string(),
        };
        Some(Constraint::Lark(format!(
            "start: thinking GAP answer\nthinking[suffix=\"</think>\"]: /(.|\\n)*/\nGAP: /[ \\t\\r\\n]*/\n{answer}"
        )))
    }

    /// The llguidance grammar this constraint compiles to.
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"})))
            }
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }

    /// Compile against a byte-level vocabulary: succeeds exactly when a worker could compile it.
    pub fn check(&self) -> Result<(), ConstraintError> {
        static BYTES: LazyLock<ParserFactory> = LazyLock::new(|| {
            factory(ApproximateTokEnv::single_byte_env()).expect("the byte-level vocabulary compiles")
        });
        BYTES.create_parser(self.grammar()).map(drop).map_err(|e| ConstraintError(clean(&e.to_string())))
    }

    /// [`Constraint::check`], and for a JSON Schema the pointer of what it refused. A JSON
    /// Schema keyword that is not one is refused here too (see docs/structured-outputs.md): a
    /// worker would compile the schema without it, and a misspelled bound would bind nothing.
    pub fn check_located(&self) -> Result<(), SchemaError> {
        if let Constraint::JsonSchema(schema) = self
            && let Some(refused) = keywords::refuse_unknown(schema)
        {
            return Err(refused);
        }
        let Err(e) = self.check() else { return Ok(()) };
        let pointer = match self {
            Constraint::JsonSchema(schema) => locate(schema, &e.0),
            _ => None,
        };
        Err(SchemaError { message: e.0, pointer })
    }
}

/// A JSON Schema as a grammar embeds it (Lark's `%json`, as tool calls do): numbers bounded as
/// `bounds` says, laid out as [`Constraint::JsonSchema`] is.
pub fn embedded_schema(schema: Value, bounds: JsonBounds) -> Value {
    compact(&bounds.apply(schema))
}

/// JSON on one line, with `", "` and `": "` between items (as Python's `json.dumps` writes it):
/// free whitespace lets a small model pad its answer with newlines until `max_tokens` runs out.
/// A schema's own `x-guidance` options (llguidance's layout settings) are kept.
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A grammar compiler for one vocabulary: `words[i]` are the bytes token `i` adds to the text.
/// A token with no bytes (a control token) can never be produced by a grammar, except `eos`,
/// which a grammar allows exactly where its output may end.
pub fn factory_for_vocab(words: &[Vec<u8>], eos: u32) -> Result<ParserFactory, ConstraintError> {
    let words: Vec<Vec<u8>> = words
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if w.is_empty() {
                // toktrie's marker for a special token: it matches no text.
                let mut s = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                s.extend_from_slice(format!("<|control_{i}|>").as_bytes());
                s
            } else {
                w.clone()
            }
        })
        .collect();
    let info = TokRxInfo::new(words.len() as u32, eos);
    factory(Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words))))
}

fn factory(env: TokEnv) -> Result<ParserFactory, ConstraintError> {
    // The general slices (llguidance's split of the vocabulary by common lexeme shapes) make
    // masks inside JSON strings an order of magnitude cheaper.
    let mut f =
        ParserFactory::new_simple(&env).map_err(|e| ConstraintError(format!("building the token table: {e}")))?;
    f.quiet();
    *f.limits_mut() = limits();
    Ok(f)
}

/// Subschemas tried at most while locating an error: the search runs only for refused schemas,
/// and stays cheap on a large one.
const LOCATE_BUDGET: usize = 64;

/// The pointer of the deepest subschema of `root` that is refused on its own with `message`
/// (compiled with the root's definitions beside it, so a `$ref` into them still resolves).
/// `None` when the error belongs to the root itself.
fn locate(root: &Value, message: &str) -> Option<String> {
    let defs: Vec<(&str, &Value)> =
        ["$defs", "definitions"].into_iter().filter_map(|k| root.get(k).map(|v| (k, v))).collect();
    let fails_alone = |sub: &Value| {
        let mut standalone = sub.clone();
        if let Value::Object(map) = &mut standalone {
            for (k, v) in &defs {
                map.entry(k.to_string()).or_insert_with(|| (*v).clone());
            }
        }
        Constraint::JsonSchema(standalone).check().err().is_some_and(|e| e.0 == message)
    };
    let mut budget = LOCATE_BUDGET;
    let (mut at, mut pointer) = (root, String::new());
    'descend: loop {
        for (path, child) in subschemas(at) {
            if budget == 0 {
                break 'descend;
            }
            budget -= 1;
            if fails_alone(child) {
                pointer.push_str(&path);
                at = child;
                continue 'descend;
            }
        }
        break;
    }
    (!pointer.is_empty()).then_some(pointer)
}

/// How a keyword holds subschemas, if it does.
enum Holds {
    /// An object of them (`properties`, `$defs`).
    Named,
    /// An array of them (`anyOf`, `prefixItems`).
    Listed,
    /// One (`items`, `not`).
    One,
}

fn holds(key: &str, value: &Value) -> Option<Holds> {
    match (key, value) {
        ("properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas", Value::Object(_)) => {
            Some(Holds::Named)
        }
        ("anyOf" | "oneOf" | "allOf" | "prefixItems" | "items", Value::Array(_)) => Some(Holds::Listed),
        (
            "items"
            | "additionalProperties"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames"
            | "additionalItems"
            | "unevaluatedProperties"
            | "unevaluatedItems",
            Value::Object(_),
        ) => Some(Holds::One),
        _ => None,
    }
}

/// The direct subschemas of a schema, with their pointer suffixes.
fn subschemas(schema: &Value) -> Vec<(String, &Value)> {
    let escape = |k: &str| k.replace('~', "~0").replace('/', "~1");
    let Value::Object(map) = schema else { return Vec::new() };
    let mut out = Vec::new();
    for (key, value) in map {
        match (holds(key, value), value) {
            (Some(Holds::Named), Value::Object(m)) => {
                out.extend(m.iter().map(|(k, v)| (format!("/{}/{}", escape(key), escape(k)), v)));
            }
            (Some(Holds::Listed), Value::Array(a)) => {
                out.extend(a.iter().enumerate().map(|(i, v)| (format!("/{key}/{i}"), v)));
            }
            (Some(Holds::One), _) => out.push((format!("/{key}"), value)),
            _ => {}
        }
    }
    out
}

/// The direct subschemas of a schema, to rewrite in place.
fn subschemas_mut(schema: &mut Value) -> Vec<&mut Value> {
    let Value::Object(map) = schema else { return Vec::new() };
    let mut out = Vec::new();
    for (key, value) in map.iter_mut() {
        match holds(key, value) {
            Some(Holds::Named) => out.extend(value.as_object_mut().into_iter().flat_map(|m| m.values_mut())),
            Some(Holds::Listed) => out.extend(value.as_array_mut().into_iter().flat_map(|a| a.iter_mut())),
            Some(Holds::One) => out.push(value),
            None => {}
        }
    }
    out
}

/// llguidance prefixes some messages with its own context ("json_schema: ..."); keep them one
/// line and bounded, since they go back to a client.
fn clean(message: &str) -> String {
    let one_line = message.split_whitespace().collect::<Vec<_>>().join(" ");
    match (0..=500).rev().find(|&i| one_line.is_char_boundary(i)) {
        Some(cut) if one_line.len() > 500 => format!("{}...", &one_line[..cut]),
        _ => one_line,
    }
}

/// Whether the whole of `text` is a complete output of `c`, compiled over single bytes.
#[cfg(test)]
fn accepts(c: &Constraint, text: &str) -> bool {
    let env = ApproximateTokEnv::single_byte_env();
    let tokens = env.tokenize_bytes(text.as_bytes());
    let parser = factory(env).unwrap().create_parser(c.grammar()).unwrap();
    let mut m = llguidance::Matcher::new(Ok(parser));
    m.validate_tokens(&tokens).unwrap() == tokens.len()
        && m.consume_tokens(&tokens).is_ok()
        && m.is_accepting().unwrap()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_is_laid_out_compactly_between_tokens_and_freely_inside_strings() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}}});
        for c in [Constraint::JsonObject, Constraint::json_schema(schema, JsonBounds::Bounded)] {
            assert!(accepts(&c, r#"{"a": 1, "b": ["x  y\n"]}"#), "{c:?}");
            for loose in [r#"{"a":1}"#, "{\n\"a\": 1}", r#"{"a": 1 }"#, r#"{"a": 1,"b": []}"#] {
                assert!(!accepts(&c, loose), "{c:?} took {loose:?}");
            }
        }
    }

    #[test]
    fn after_thinking_the_answer_is_held_to_the_constraint_and_the_thinking_is_free() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let c = Constraint::json_schema(schema, JsonBounds::Bounded).after_thinking().unwrap();
        assert_eq!(c.check(), Ok(()));
        assert!(accepts(&c, "Let me see: {\"a\": 1}?\n</think>\n\n{\"a\": 2}"), "JSON in the thinking is free");
        assert!(accepts(&c, "</think>{\"a\": 3}"), "empty thinking, no gap");
        assert!(!accepts(&c, "{\"a\": 1}"), "the thinking must close first");
        assert!(!accepts(&c, "hmm</think>\n\nnot json"));
        let rx = Constraint::Regex("(cat|dog)-[0-9]{2}".into()).after_thinking().unwrap();
        assert!(accepts(&rx, "pets</think>\ndog-42") && !accepts(&rx, "pets</think>\ndog-4"));
        assert!(accepts(&Constraint::JsonObject.after_thinking().unwrap(), "x</think>{}"));
        assert_eq!(Constraint::Lark("start: \"y\"".into()).after_thinking(), None, "a client's grammar is not nested");
        let ours = Constraint::Lark(format!("{NESTABLE_START}answer: \"<call>\" %json {{\"type\": \"object\"}}"));
        let nested = ours.after_thinking().unwrap();
        assert!(accepts(&nested, "ok</think>\n<call>{}") && !accepts(&nested, "<call>{}"));
    }

    #[test]
    fn a_schema_embedded_in_a_grammar_is_bounded_and_laid_out_compactly() {
        let args = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let lark =
            |bounds| Constraint::Lark(format!("start: \"<call>\" %json {}", embedded_schema(args.clone(), bounds)));
        let c = lark(JsonBounds::Bounded);
        assert!(accepts(&c, r#"<call>{"n": 42}"#));
        assert!(!accepts(&c, r#"<call>{"n":42}"#), "compact");
        assert!(!accepts(&c, r#"<call>{"n": 12345678901234567890}"#), "bounded");
        assert!(accepts(&lark(JsonBounds::Unbounded), r#"<call>{"n": 12345678901234567890}"#));
    }

    #[test]
    fn a_misspelled_keyword_is_refused_naming_it_and_where_it_is() {
        let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLenght": 8}}});
        let refused = Constraint::JsonSchema(schema.clone()).check_located().unwrap_err();
        assert!(refused.message.contains("'maxLenght'"), "{}", refused.message);
        assert_eq!(refused.pointer.as_deref(), Some("/properties/name"));
        // Deeper, under $defs and anyOf, and at the root.
        let nested = json!({"$defs": {"n": {"anyOf": [{"type": "integer", "minimun": 0}]}}, "$ref": "#/$defs/n"});
        let refused = Constraint::JsonSchema(nested).check_located().unwrap_err();
        assert_eq!(
            (refused.pointer.as_deref(), refused.message.contains("'minimun'")),
            (Some("/$defs/n/anyOf/0"), true)
        );
        let root = Constraint::JsonSchema(json!({"type": "string", "nullable": true})).check_located().unwrap_err();
        assert_eq!(root.pointer, None);
        // llguidance alone would have taken it, unbounded.
        assert_eq!(Constraint::JsonSchema(schema).check(), Ok(()));
    }

    #[test]
    fn annotations_extensions_and_a_lenient_schema_pass_the_keyword_check() {
        let annotated = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "T", "description": "d",
            "type": "object", "x-order": 1, "discriminator": {"propertyName": "kind"},
            "properties": {"maxLenght": {"type": "string", "default": "a", "examples": ["b"], "deprecated": true}},
        });
        assert_eq!(Constraint::JsonSchema(annotated).check_located(), Ok(()), "a property may be named anything");
        let lenient = json!({"x-guidance": {"lenient": true}, "type": "object",
            "properties": {"name": {"type": "string", "maxLenght": 8, "uniqueItems": true}}});
        assert_eq!(Constraint::JsonSchema(lenient).check_located(), Ok(()));
        // Without lenient, a vocabulary keyword llguidance lacks is still refused (by llguidance).
        let unique = json!({"type": "array", "uniqueItems": true});
        let refused = Constraint::JsonSchema(unique).check_located().unwrap_err();
        assert!(refused.message.contains("uniqueItems"), "{}", refused.message);
    }

    #[test]
    fn a_valid_schema_regex_and_grammar_compile() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        assert_eq!(Constraint::JsonSchema(schema).check(), Ok(()));
        assert_eq!(Constraint::JsonObject.check(), Ok(()));
        assert_eq!(Constraint::Regex("[a-z]{3}-[0-9]+".into()).check(), Ok(()));
        assert_eq!(Constraint::Lark("start: \"yes\" | \"no\"".into()).check(), Ok(()));
        let embedded = "start: \"<a>\" obj (\"\\n\" obj)*\nobj: %json {\"type\": \"object\", \"properties\": {\"n\": {\"const\": 1}}}";
        assert_eq!(Constraint::Lark(embedded.into()).check(), Ok(()), "a JSON Schema inside a grammar");
    }

    #[test]
    fn an_invalid_schema_regex_or_grammar_is_refused_with_a_message() {
        for c in [
            Constraint::JsonSchema(json!({"type": "no-such-type"})),
            Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})),
            Constraint::Regex("(unclosed".into()),
            Constraint::Lark("start: undefined_rule".into()),
        ] {
            let e = c.check().expect_err(&format!("{c:?} should be refused"));
            assert!(!e.0.is_empty() && !e.0.contains('\n'), "{c:?}: {e}");
        }
    }

    #[test]
    fn a_refused_schema_names_the_pointer_of_the_subschema_at_fault() {
        let schema = json!({
            "type": "object",
            "properties": {
                "ok": {"type": "string"},
                "outer": {"type": "object", "properties": {"a/b": {"type": "array", "items": {"type": "strin"}}}},
            },
        });
        let e = Constraint::JsonSchema(schema).check_located().unwrap_err();
        assert_eq!(e.pointer.as_deref(), Some("/properties/outer/properties/a~1b/items"), "{e:?}");
        assert!(e.message.contains("strin"), "{e:?}");

        let e = Constraint::JsonSchema(json!({"type": "strin"})).check_located().unwrap_err();
        assert_eq!(e.pointer, None, "the root itself is at fault");
    }

    #[test]
    fn a_ref_into_the_root_definitions_does_not_mislead_the_pointer() {
        let schema = json!({
            "$defs": {"name": {"type": "string", "format": "no-such-format"}},
            "type": "object",
            "properties": {"first": {"$ref": "#/$defs/name"}, "n": {"type": "integer"}},
        });
        let e = Constraint::JsonSchema(schema).check_located().unwrap_err();
        assert_eq!(e.pointer.as_deref(), Some("/$defs/name"), "{e:?}");
    }

    #[test]
    fn a_grammar_over_the_size_limit_is_refused() {
        // An enum of 100k distinct strings: well over the grammar-size limit.
        let many: Vec<String> = (0..100_000).map(|i| format!("value-{i}")).collect();
        let e = Constraint::JsonSchema(json!({"enum": many})).check().unwrap_err();
        assert!(e.0.to_lowercase().contains("size") || e.0.contains("limit"), "{e}");
    }
}
