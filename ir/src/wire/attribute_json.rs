//! The proto3 JSON of `Attribute`, `IntList` and `FloatList`, written by hand instead of by
//! pbjson, so that every float round-trips bit for bit and a long list is written without a
//! copy of it.
//!
//! Floats: a finite double is written as the shortest decimal that reads back to the same bits
//! (and read with `serde_json`'s exact `float_roundtrip` parser); the infinities and the
//! canonical NaN are the proto3 strings `"Infinity"`, `"-Infinity"` and `"NaN"`. Any other NaN
//! (another sign or payload, as x86 arithmetic makes) is `"NaN(0x<16 hex digits>)"` with its
//! bits, this project's extension in the spirit of C's `nan("...")`. Reading also accepts a
//! number given as a string, as proto3 JSON allows. Everything else follows pbjson: an
//! `int64` is a string, a second member of the `oneof` is a duplicate field, unknown fields are
//! errors.

use std::{fmt, marker::PhantomData};

use serde::{
    de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor},
    ser::{SerializeSeq, SerializeStruct},
    Deserialize, Deserializer, Serialize, Serializer,
};

use super::graph::{attribute::Value as AttrValue, Attribute, FloatList, IntList, StringList};

/// The bits of the NaN written as plain `"NaN"` (Rust's `f64::NAN`, Python's `float("nan")`).
const CANONICAL_NAN: u64 = 0x7ff8_0000_0000_0000;

/// A double as proto3 JSON, exact.
#[derive(Debug, Clone, Copy)]
pub struct JsonF64(pub f64);

impl Serialize for JsonF64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_finite() {
            serializer.serialize_f64(v)
        } else if v == f64::INFINITY {
            serializer.serialize_str("Infinity")
        } else if v == f64::NEG_INFINITY {
            serializer.serialize_str("-Infinity")
        } else if v.to_bits() == CANONICAL_NAN {
            serializer.serialize_str("NaN")
        } else {
            serializer.collect_str(&format_args!("NaN(0x{:016x})", v.to_bits()))
        }
    }
}

impl<'de> Deserialize<'de> for JsonF64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(F64Visitor).map(JsonF64)
    }
}

struct F64Visitor;

impl Visitor<'_> for F64Visitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number, or a string holding one")
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        parse_f64(v).ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}

/// A double written as a string: `NaN(0x...)` with its bits, or anything Rust parses (a
/// decimal, `NaN`, `Infinity`, `-Infinity`).
fn parse_f64(text: &str) -> Option<f64> {
    match text
        .strip_prefix("NaN(0x")
        .and_then(|rest| rest.strip_suffix(')'))
    {
        Some(hex) if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            u64::from_str_radix(hex, 16)
                .ok()
                .map(f64::from_bits)
                .filter(|v| v.is_nan())
        }
        Some(_) => None,
        None => text.parse().ok(),
    }
}

/// A number written as a JSON string without an intermediate `String` (proto3 JSON writes
/// `int64` as a string).
struct AsString<T>(T);

impl<T: fmt::Display> Serialize for AsString<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

/// A list serialised item by item through `wrap`, without building another list.
struct Each<'a, T, W>(&'a [T], fn(&T) -> W);

impl<T, W: Serialize> Serialize for Each<'_, T, W> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for item in self.0 {
            seq.serialize_element(&(self.1)(item))?;
        }
        seq.end()
    }
}

impl Serialize for Attribute {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let len = usize::from(!self.name.is_empty()) + usize::from(self.value.is_some());
        let mut s = serializer.serialize_struct("recompute.ir.v1.Attribute", len)?;
        if !self.name.is_empty() {
            s.serialize_field("name", &self.name)?;
        }
        match &self.value {
            Some(AttrValue::Int(v)) => s.serialize_field("int", &AsString(v))?,
            Some(AttrValue::Float(v)) => s.serialize_field("float", &JsonF64(*v))?,
            Some(AttrValue::Str(v)) => s.serialize_field("str", v)?,
            Some(AttrValue::Bool(v)) => s.serialize_field("bool", v)?,
            Some(AttrValue::Ints(v)) => s.serialize_field("ints", v)?,
            Some(AttrValue::Floats(v)) => s.serialize_field("floats", v)?,
            Some(AttrValue::Strs(v)) => s.serialize_field("strs", v)?,
            None => {}
        }
        s.end()
    }
}

impl Serialize for IntList {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let values = Each(&self.values, |&v| AsString(v));
        serialize_list(
            serializer,
            "recompute.ir.v1.IntList",
            &values,
            self.values.len(),
        )
    }
}

impl Serialize for FloatList {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let values = Each(&self.values, |&v| JsonF64(v));
        serialize_list(
            serializer,
            "recompute.ir.v1.FloatList",
            &values,
            self.values.len(),
        )
    }
}

/// A list message: one `values` field, left out when empty.
fn serialize_list<S: Serializer>(
    serializer: S,
    message: &'static str,
    values: &impl Serialize,
    len: usize,
) -> Result<S::Ok, S::Error> {
    let mut s = serializer.serialize_struct(message, usize::from(len > 0))?;
    if len > 0 {
        s.serialize_field("values", values)?;
    }
    s.end()
}

/// A key of a JSON object whose fields are `FIELDS`: its position there. An unknown key is
/// an error naming the expected ones, as pbjson's.
pub(crate) struct FieldKey(pub &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for FieldKey {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_identifier(self)
    }
}

impl Visitor<'_> for FieldKey {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expected one of: {:?}", self.0)
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<usize, E> {
        self.0
            .iter()
            .position(|&f| f == key)
            .ok_or_else(|| E::unknown_field(key, self.0))
    }
}

const ATTRIBUTE_FIELDS: &[&str] = &[
    "name", "int", "float", "str", "bool", "ints", "floats", "strs",
];

impl<'de> Deserialize<'de> for Attribute {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_struct(
            "recompute.ir.v1.Attribute",
            ATTRIBUTE_FIELDS,
            AttributeVisitor,
        )
    }
}

struct AttributeVisitor;

impl<'de> Visitor<'de> for AttributeVisitor {
    type Value = Attribute;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct recompute.ir.v1.Attribute")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Attribute, A::Error> {
        use pbjson::private::NumberDeserialize;
        let mut name: Option<String> = None;
        let mut value: Option<AttrValue> = None;
        while let Some(field) = map.next_key_seed(FieldKey(ATTRIBUTE_FIELDS))? {
            let key = ATTRIBUTE_FIELDS[field];
            if field == 0 {
                if name.is_some() {
                    return Err(de::Error::duplicate_field(key));
                }
                name = Some(map.next_value()?);
                continue;
            }
            // The other fields are the members of the `oneof`: at most one may be set.
            if value.is_some() {
                return Err(de::Error::duplicate_field(key));
            }
            value = match key {
                "int" => map
                    .next_value::<Option<NumberDeserialize<i64>>>()?
                    .map(|v| AttrValue::Int(v.0)),
                "float" => map
                    .next_value::<Option<JsonF64>>()?
                    .map(|v| AttrValue::Float(v.0)),
                "str" => map.next_value::<Option<String>>()?.map(AttrValue::Str),
                "bool" => map.next_value::<Option<bool>>()?.map(AttrValue::Bool),
                "ints" => map.next_value::<Option<IntList>>()?.map(AttrValue::Ints),
                "floats" => map
                    .next_value::<Option<FloatList>>()?
                    .map(AttrValue::Floats),
                _ => map.next_value::<Option<StringList>>()?.map(AttrValue::Strs),
            };
        }
        Ok(Attribute {
            name: name.unwrap_or_default(),
            value,
        })
    }
}

const LIST_FIELDS: &[&str] = &["values"];

impl<'de> Deserialize<'de> for IntList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let visitor = ListVisitor::<pbjson::private::NumberDeserialize<i64>, i64>::new(
            "struct recompute.ir.v1.IntList",
            |v| v.0,
        );
        let values =
            deserializer.deserialize_struct("recompute.ir.v1.IntList", LIST_FIELDS, visitor)?;
        Ok(IntList { values })
    }
}

impl<'de> Deserialize<'de> for FloatList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let visitor = ListVisitor::<JsonF64, f64>::new("struct recompute.ir.v1.FloatList", |v| v.0);
        let values =
            deserializer.deserialize_struct("recompute.ir.v1.FloatList", LIST_FIELDS, visitor)?;
        Ok(FloatList { values })
    }
}

/// A list message's `values`, each item read as `R` and kept as `T`.
struct ListVisitor<R, T> {
    message: &'static str,
    keep: fn(R) -> T,
    _items: PhantomData<fn() -> (R, T)>,
}

impl<R, T> ListVisitor<R, T> {
    fn new(message: &'static str, keep: fn(R) -> T) -> Self {
        ListVisitor {
            message,
            keep,
            _items: PhantomData,
        }
    }
}

impl<'de, R: Deserialize<'de>, T> Visitor<'de> for ListVisitor<R, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<T>, A::Error> {
        let mut values = None;
        while map.next_key_seed(FieldKey(LIST_FIELDS))?.is_some() {
            if values.is_some() {
                return Err(de::Error::duplicate_field("values"));
            }
            values = Some(map.next_value_seed(Items::<R, T>(self.keep, PhantomData))?);
        }
        Ok(values.unwrap_or_default())
    }
}

/// A JSON array read item by item straight into the list it becomes.
struct Items<R, T>(fn(R) -> T, PhantomData<fn() -> R>);

impl<'de, R: Deserialize<'de>, T> DeserializeSeed<'de> for Items<R, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, R: Deserialize<'de>, T> Visitor<'de> for Items<R, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element::<R>()? {
            items.push((self.0)(item));
        }
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(v: f64) -> f64 {
        let json = serde_json::to_string(&JsonF64(v)).unwrap();
        serde_json::from_str::<JsonF64>(&json).unwrap().0
    }

    #[test]
    fn special_values_use_the_proto3_spellings() {
        let json = |v: f64| serde_json::to_string(&JsonF64(v)).unwrap();
        assert_eq!(json(f64::INFINITY), r#""Infinity""#);
        assert_eq!(json(f64::NEG_INFINITY), r#""-Infinity""#);
        assert_eq!(json(f64::NAN), r#""NaN""#);
        assert_eq!(json(-f64::NAN), r#""NaN(0xfff8000000000000)""#);
        assert_eq!(json(-0.0), "-0.0");
    }

    #[test]
    fn float32_min_reads_back_exactly() {
        let v = f64::from(f32::MIN);
        assert_eq!(round_trip(v).to_bits(), v.to_bits());
        let parsed: JsonF64 = serde_json::from_str("-3.4028234663852886e+38").unwrap();
        assert_eq!(parsed.0.to_bits(), v.to_bits());
    }

    #[test]
    fn numbers_in_strings_and_malformed_nan_bits() {
        let read = |s: &str| serde_json::from_str::<JsonF64>(s).map(|v| v.0.to_bits());
        assert_eq!(read(r#""1.5""#).unwrap(), 1.5f64.to_bits());
        assert_eq!(read(r#""-Infinity""#).unwrap(), f64::NEG_INFINITY.to_bits());
        assert_eq!(
            read(r#""NaN(0x7ff0000000000001)""#).unwrap(),
            0x7ff0_0000_0000_0001
        );
        // Bits of a number that is not a NaN, short or long digits: not a float.
        assert!(read(r#""NaN(0x3ff0000000000000)""#).is_err());
        assert!(read(r#""NaN(0x7ff8)""#).is_err());
        assert!(read(r#""NaN(0x7ff80000000000000)""#).is_err());
        assert!(read("true").is_err());
    }
}
