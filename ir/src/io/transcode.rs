//! Graphs transcoded between proto3 JSON and protobuf without ever decoding a message whole:
//! a decoded element can be a hundred times its encoding (`{}` is a 300-byte node), so a file
//! of millions of small elements, or one element of millions of small parts, would otherwise
//! cost memory out of all proportion to its size.
//!
//! - JSON -> protobuf ([`to_protobuf`]): every message is encoded as it is read, and every
//!   repeated field item by item; the reader holds the encoding (at most a few times the JSON)
//!   and one message per level of nesting being read. Each value is read as pbjson reads it,
//!   so what is accepted, and the errors, are pbjson's: both spellings of a field name, an
//!   `int64` as a number or a string, `null` for a message, an `optional` field or a `oneof`
//!   member meaning absent, an unknown or repeated key an error. Integers and enums are read
//!   by `json_value`, which words their errors plainly, naming the field, at the same place.
//! - protobuf -> canonical protobuf or JSON ([`write_protobuf`], [`write_json`]): each field
//!   is resolved in the encoded bytes as prost decodes it (the last scalar wins, repeated
//!   fields append, packed or not, messages merge, the last `oneof` member wins) and written as
//!   prost encodes it or as pbjson serialises it.
//!
//! The messages are described by tables (`GRAPH`, `NODE`, ...) that `build.rs` writes from
//! `proto/graph.proto`'s descriptor. `ir/tests/streaming.rs` holds every direction to pbjson and prost on
//! arbitrary graphs, non-canonical encodings and malformed JSON.

use std::{fmt, marker::PhantomData, ops::Range};

use prost::encoding::{encode_key, encode_varint, WireType};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use super::json_value::{EnumNames, EnumOf, IntegerOf};
use crate::wire::{graph as pb, FieldKey, JsonF64};

/// The canonical protobuf encoding of the JSON graph in `json`; a JSON error is where pbjson's
/// would be.
pub(crate) fn to_protobuf(json: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(json);
    let encoded = Transcode(&GRAPH).deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(encoded)
}

/// A message: its full name (in messages) and fields. `keys` lists the JSON keys pbjson
/// accepts, in its order: each field's name, then its camelCase name when it differs.
pub(crate) struct Message {
    name: &'static str,
    keys: &'static [&'static str],
    fields: &'static [Field],
}

struct Field {
    name: &'static str,
    /// The proto3 JSON (camelCase) name; pbjson names a repeated key by it.
    json: &'static str,
    tag: u32,
    kind: Kind,
}

/// How a field's JSON value is read and encoded.
#[derive(Clone, Copy)]
enum Kind {
    /// `string`, left out when empty.
    Str,
    /// `bool`, left out when false.
    Bool,
    /// `uint32`, left out when zero.
    U32,
    /// `optional uint32`: `null` is absent; any number is written.
    OptionalU32,
    /// An enum by name or number, left out when zero.
    Enum(EnumType),
    /// `repeated string`, every item written.
    Strings,
    /// `repeated int64`, `repeated uint32` and `repeated double`, packed.
    PackedI64,
    PackedU32,
    PackedF64,
    /// A message field: `null` is absent.
    Message(&'static Message),
    Messages(&'static Message),
    /// A member of the message's one `oneof`: `null` is absent, a value is written even
    /// when it is the default, and a second member is a duplicate field.
    OneofI64,
    OneofF64,
    OneofStr,
    OneofBool,
    OneofMessage(&'static Message),
}

const fn field(name: &'static str, json: &'static str, tag: u32, kind: Kind) -> Field {
    Field {
        name,
        json,
        tag,
        kind,
    }
}

// The message tables and `EnumType`, written by `build.rs` from `graph.proto`'s descriptor
// (`ir/build/schema.rs`).
include!(concat!(env!("OUT_DIR"), "/graph_tables.rs"));

impl Message {
    fn field(&self, key: &str) -> Option<&'static Field> {
        self.fields.iter().find(|f| f.name == key || f.json == key)
    }
}

/// Reads one JSON message described by its table, into its canonical encoding.
pub(crate) struct Transcode(pub &'static Message);

impl<'de> DeserializeSeed<'de> for Transcode {
    type Value = Vec<u8>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_struct(self.0.name, self.0.keys, self)
    }
}

impl<'de> Visitor<'de> for Transcode {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "struct {}", self.0.name)
    }

    /// Encodes each field as it comes, into one buffer, keeping the span of each: fields
    /// given out of field-number order are put in order at the end (in canonical JSON they
    /// are in order already, and nothing is copied).
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<u8>, A::Error> {
        let message = self.0;
        let mut out = Vec::new();
        let mut spans: Vec<(u32, Range<usize>)> = Vec::new();
        let mut oneof_set = false;
        while let Some(key) = map.next_key_seed(FieldKey(message.keys))? {
            let field = message
                .field(message.keys[key])
                .ok_or_else(|| de::Error::unknown_field(message.keys[key], message.keys))?;
            let repeated = spans.iter().any(|(tag, _)| *tag == field.tag);
            let oneof = field.kind.is_oneof();
            if repeated || (oneof && oneof_set) {
                return Err(de::Error::duplicate_field(field.json));
            }
            let start = out.len();
            if read_field(&mut map, field, &mut out)? {
                spans.push((field.tag, start..out.len()));
                oneof_set |= oneof;
            }
        }
        if spans.is_sorted_by_key(|(tag, _)| *tag) {
            return Ok(out);
        }
        spans.sort_by_key(|(tag, _)| *tag);
        let mut ordered = Vec::with_capacity(out.len());
        for (_, span) in spans {
            ordered.extend_from_slice(&out[span]);
        }
        Ok(ordered)
    }
}

impl Kind {
    fn is_oneof(self) -> bool {
        matches!(
            self,
            Kind::OneofI64
                | Kind::OneofF64
                | Kind::OneofStr
                | Kind::OneofBool
                | Kind::OneofMessage(_)
        )
    }
}

/// Reads the value of `field` and appends its encoding to `out`. Returns whether the field
/// was given (`null` for a message, an `optional` field or a `oneof` member is not).
fn read_field<'de, A: MapAccess<'de>>(
    map: &mut A,
    field: &Field,
    out: &mut Vec<u8>,
) -> Result<bool, A::Error> {
    let tag = field.tag;
    match field.kind {
        Kind::Str => {
            let s: String = map.next_value()?;
            if !s.is_empty() {
                encode_bytes(tag, s.as_bytes(), out);
            }
        }
        Kind::Bool => {
            if map.next_value::<bool>()? {
                encode_varint_field(tag, 1, out);
            }
        }
        Kind::U32 => {
            let v = map.next_value_seed(IntegerOf::<u32>::field(field.json))?;
            if v != 0 {
                encode_varint_field(tag, u64::from(v), out);
            }
        }
        Kind::OptionalU32 => {
            match map.next_value_seed(Nullable(IntegerOf::<u32>::field(field.json)))? {
                Some(v) => encode_varint_field(tag, u64::from(v), out),
                None => return Ok(false),
            }
        }
        Kind::Enum(kind) => {
            let v = map.next_value_seed(EnumOf {
                field: field.json,
                names: kind,
            })?;
            if v != 0 {
                // An `int32` is sign-extended to 64 bits on the wire.
                encode_varint_field(tag, i64::from(v) as u64, out);
            }
        }
        Kind::Strings => map.next_value_seed(Items(tag, out, EncodeStrings))?,
        Kind::PackedI64 => {
            let payload = map.next_value_seed(Packed(
                IntegerOf::<i64>::field(field.json),
                |v: i64, out| encode_varint(v as u64, out),
            ))?;
            encode_packed(tag, &payload, out);
        }
        Kind::PackedU32 => {
            let payload = map.next_value_seed(Packed(
                IntegerOf::<u32>::field(field.json),
                |v: u32, out| encode_varint(u64::from(v), out),
            ))?;
            encode_packed(tag, &payload, out);
        }
        Kind::PackedF64 => {
            let payload = map
                .next_value_seed(Packed(PhantomData::<JsonF64>, |v: JsonF64, out| {
                    out.extend_from_slice(&v.0.to_bits().to_le_bytes())
                }))?;
            encode_packed(tag, &payload, out);
        }
        Kind::Message(message) | Kind::OneofMessage(message) => {
            match map.next_value_seed(Nullable(Transcode(message)))? {
                Some(body) => encode_bytes(tag, &body, out),
                None => return Ok(false),
            }
        }
        Kind::Messages(message) => map.next_value_seed(Items(tag, out, EncodeMessage(message)))?,
        Kind::OneofI64 => {
            match map.next_value_seed(Nullable(IntegerOf::<i64>::field(field.json)))? {
                Some(v) => encode_varint_field(tag, v as u64, out),
                None => return Ok(false),
            }
        }
        Kind::OneofF64 => match map.next_value::<Option<JsonF64>>()? {
            Some(v) => {
                encode_key(tag, WireType::SixtyFourBit, out);
                out.extend_from_slice(&v.0.to_bits().to_le_bytes());
            }
            None => return Ok(false),
        },
        Kind::OneofStr => match map.next_value::<Option<String>>()? {
            Some(s) => encode_bytes(tag, s.as_bytes(), out),
            None => return Ok(false),
        },
        Kind::OneofBool => match map.next_value::<Option<bool>>()? {
            Some(b) => encode_varint_field(tag, u64::from(b), out),
            None => return Ok(false),
        },
    }
    Ok(true)
}

fn encode_varint_field(tag: u32, value: u64, out: &mut Vec<u8>) {
    encode_key(tag, WireType::Varint, out);
    encode_varint(value, out);
}

fn encode_bytes(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// A packed field: left out when it holds nothing.
fn encode_packed(tag: u32, payload: &[u8], out: &mut Vec<u8>) {
    if !payload.is_empty() {
        encode_bytes(tag, payload, out);
    }
}

/// A JSON array whose items are each encoded as field `.0` as soon as they are read.
struct Items<'o, E>(u32, &'o mut Vec<u8>, E);

impl<'de, E: ItemEncoder<'de>> DeserializeSeed<'de> for Items<'_, E> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, E: ItemEncoder<'de>> Visitor<'de> for Items<'_, E> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Items(tag, out, encoder) = self;
        while encoder.next(&mut seq, tag, out)? {}
        Ok(())
    }
}

/// Reads the next item of a sequence and encodes it as field `tag`; false at the end.
trait ItemEncoder<'de> {
    fn next<A: SeqAccess<'de>>(
        &self,
        seq: &mut A,
        tag: u32,
        out: &mut Vec<u8>,
    ) -> Result<bool, A::Error>;
}

/// Strings of a repeated string field.
struct EncodeStrings;

impl<'de> ItemEncoder<'de> for EncodeStrings {
    fn next<A: SeqAccess<'de>>(
        &self,
        seq: &mut A,
        tag: u32,
        out: &mut Vec<u8>,
    ) -> Result<bool, A::Error> {
        match seq.next_element::<String>()? {
            Some(s) => {
                encode_bytes(tag, s.as_bytes(), out);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// Messages of a repeated message field, each transcoded.
struct EncodeMessage(&'static Message);

impl<'de> ItemEncoder<'de> for EncodeMessage {
    fn next<A: SeqAccess<'de>>(
        &self,
        seq: &mut A,
        tag: u32,
        out: &mut Vec<u8>,
    ) -> Result<bool, A::Error> {
        match seq.next_element_seed(Transcode(self.0))? {
            Some(body) => {
                encode_bytes(tag, &body, out);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// A JSON array of numbers read into a packed payload, each item read by the seed `.0` and
/// appended by `.1`.
struct Packed<'de, S: DeserializeSeed<'de>>(S, fn(S::Value, &mut Vec<u8>));

impl<'de, S: DeserializeSeed<'de> + Copy> DeserializeSeed<'de> for Packed<'de, S> {
    type Value = Vec<u8>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, S: DeserializeSeed<'de> + Copy> Visitor<'de> for Packed<'de, S> {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        let mut payload = Vec::new();
        while let Some(item) = seq.next_element_seed(self.0)? {
            (self.1)(item, &mut payload);
        }
        Ok(payload)
    }
}

/// A value that may be `null` (then absent), read by the seed `.0` otherwise.
struct Nullable<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<S> {
    type Value = Option<S::Value>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Nullable<S> {
    type Value = Option<S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("option")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        self.0.deserialize(deserializer).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every table, and the tables it reaches.
    fn tables() -> Vec<&'static Message> {
        let mut seen: Vec<&'static Message> = vec![&GRAPH];
        let mut i = 0;
        while i < seen.len() {
            for f in seen[i].fields {
                if let Kind::Message(m) | Kind::Messages(m) | Kind::OneofMessage(m) = f.kind {
                    if !seen.iter().any(|s| std::ptr::eq(*s, m)) {
                        seen.push(m);
                    }
                }
            }
            i += 1;
        }
        seen
    }

    #[test]
    fn keys_list_each_field_by_name_then_by_its_json_name() {
        let tables = tables();
        assert_eq!(tables.len(), 12, "every message of graph.proto has a table");
        for message in tables {
            let mut keys = Vec::new();
            for f in message.fields {
                keys.push(f.name);
                if f.json != f.name {
                    keys.push(f.json);
                }
            }
            assert_eq!(keys, message.keys, "{}", message.name);
        }
    }
}

/// One occurrence of a field in an encoded message.
#[derive(Clone, Copy)]
enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    /// A 32-bit or group field: no field of the IR has one (only unknown fields do).
    Other,
}

/// The fields of the occurrences `parts` of one message (prost merges them into one value), in
/// order, as (tag, value). The bytes were checked to decode; a malformed rest would end them.
fn fields<'p, 'a: 'p>(parts: &'p [&'a [u8]]) -> impl Iterator<Item = (u32, Wire<'a>)> + 'p {
    use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext};
    parts.iter().flat_map(|&part| {
        let mut buf = part;
        std::iter::from_fn(move || {
            if buf.is_empty() {
                return None;
            }
            let (tag, wire) = decode_key(&mut buf).ok()?;
            let value = match wire {
                WireType::Varint => Wire::Varint(decode_varint(&mut buf).ok()?),
                WireType::SixtyFourBit => {
                    let (bytes, rest) = buf.split_first_chunk::<8>()?;
                    buf = rest;
                    Wire::Fixed64(u64::from_le_bytes(*bytes))
                }
                WireType::LengthDelimited => {
                    let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
                    let (bytes, rest) = buf.split_at_checked(len)?;
                    buf = rest;
                    Wire::Bytes(bytes)
                }
                _ => {
                    skip_field(wire, tag, &mut buf, DecodeContext::default()).ok()?;
                    Wire::Other
                }
            };
            Some((tag, value))
        })
    })
}

/// An encoded message of the table `spec`: the payloads of its occurrences, merged as prost
/// merges them (the last scalar wins, repeated fields append, messages merge).
struct EncodedMessage<'a> {
    spec: &'static Message,
    parts: Vec<&'a [u8]>,
}

impl<'a> EncodedMessage<'a> {
    fn new(spec: &'static Message, parts: Vec<&'a [u8]>) -> Self {
        EncodedMessage { spec, parts }
    }

    /// The last occurrence of field `tag`.
    fn last(&self, tag: u32) -> Option<Wire<'a>> {
        fields(&self.parts)
            .filter(|&(t, _)| t == tag)
            .map(|(_, w)| w)
            .last()
    }

    /// The payloads of every occurrence of field `tag`.
    fn all(&self, tag: u32) -> impl Iterator<Item = Wire<'a>> + '_ {
        fields(&self.parts)
            .filter(move |&(t, _)| t == tag)
            .map(|(_, w)| w)
    }

    /// The member of the `oneof` set last, and the occurrences of it that prost merges into
    /// its value (those after the last occurrence of another member).
    fn oneof(&self) -> Option<(&'static Field, Vec<Wire<'a>>)> {
        let mut current: Option<(&'static Field, Vec<Wire<'a>>)> = None;
        for (tag, wire) in fields(&self.parts) {
            let Some(field) = self.spec.fields.iter().find(|f| f.tag == tag) else {
                continue;
            };
            if !field.kind.is_oneof() {
                continue;
            }
            match &mut current {
                Some((f, occurrences)) if f.tag == tag => occurrences.push(wire),
                _ => current = Some((field, vec![wire])),
            }
        }
        current
    }

    /// Whether `field` is written (proto3: a scalar at its default is not).
    fn present(&self, field: &Field) -> bool {
        match field.kind {
            Kind::Str => matches!(self.last(field.tag), Some(Wire::Bytes(b)) if !b.is_empty()),
            Kind::Bool => matches!(self.last(field.tag), Some(Wire::Varint(v)) if v != 0),
            Kind::U32 => matches!(self.last(field.tag), Some(Wire::Varint(v)) if v as u32 != 0),
            Kind::Enum(_) => matches!(self.last(field.tag), Some(Wire::Varint(v)) if v as i32 != 0),
            Kind::OptionalU32 | Kind::Message(_) | Kind::Messages(_) | Kind::Strings => {
                self.all(field.tag).next().is_some()
            }
            Kind::PackedI64 | Kind::PackedU32 | Kind::PackedF64 => {
                numbers(self.all(field.tag), field.kind).next().is_some()
            }
            Kind::OneofI64
            | Kind::OneofF64
            | Kind::OneofStr
            | Kind::OneofBool
            | Kind::OneofMessage(_) => {
                matches!(self.oneof(), Some((f, _)) if f.tag == field.tag)
            }
        }
    }
}

/// The numbers of a repeated number field's occurrences, packed or not, as raw `u64`s (a
/// varint's value, a double's bits).
fn numbers<'a>(
    occurrences: impl Iterator<Item = Wire<'a>> + 'a,
    kind: Kind,
) -> impl Iterator<Item = u64> + 'a {
    use prost::encoding::decode_varint;
    occurrences.flat_map(move |wire| {
        let (single, mut packed): (Option<u64>, &[u8]) = match wire {
            Wire::Varint(v) | Wire::Fixed64(v) => (Some(v), &[]),
            Wire::Bytes(b) => (None, b),
            Wire::Other => (None, &[]),
        };
        let run = std::iter::from_fn(move || {
            if packed.is_empty() {
                return None;
            }
            match kind {
                Kind::PackedF64 => {
                    let (bytes, rest) = packed.split_first_chunk::<8>()?;
                    packed = rest;
                    Some(u64::from_le_bytes(*bytes))
                }
                _ => decode_varint(&mut packed).ok(),
            }
        });
        single.into_iter().chain(run)
    })
}

/// The occurrences of a message field as the parts of one merged message.
fn message_parts<'a>(occurrences: impl Iterator<Item = Wire<'a>>) -> Vec<&'a [u8]> {
    occurrences
        .filter_map(|wire| match wire {
            Wire::Bytes(bytes) => Some(bytes),
            _ => None,
        })
        .collect()
}

/// Writes the canonical protobuf encoding (prost's encoding of the message it decodes to) of
/// the graph encoded in `bytes`, which must decode, to `out`: one element at a time, never
/// decoding the graph or an element whole.
pub(crate) fn write_protobuf(bytes: &[u8], out: &mut impl std::io::Write) -> std::io::Result<()> {
    let graph = EncodedMessage::new(&GRAPH, vec![bytes]);
    let mut element = Vec::new();
    for field in GRAPH.fields {
        if let Kind::Messages(spec) = field.kind {
            // The graph's elements: each built alone, then written.
            for wire in graph.all(field.tag) {
                if let Wire::Bytes(b) = wire {
                    element.clear();
                    encode_message(&EncodedMessage::new(spec, vec![b]), &mut element);
                    let mut head = Vec::new();
                    encode_key(field.tag, WireType::LengthDelimited, &mut head);
                    encode_varint(element.len() as u64, &mut head);
                    out.write_all(&head)?;
                    out.write_all(&element)?;
                }
            }
        } else {
            element.clear();
            encode_field(&graph, field, &mut element);
            out.write_all(&element)?;
        }
    }
    Ok(())
}

/// Appends the canonical encoding of every field of `message` to `out`.
fn encode_message(message: &EncodedMessage<'_>, out: &mut Vec<u8>) {
    for field in message.spec.fields {
        encode_field(message, field, out);
    }
}

/// Appends the canonical encoding of `field` of `message` to `out` (nothing when absent).
fn encode_field(message: &EncodedMessage<'_>, field: &Field, out: &mut Vec<u8>) {
    let tag = field.tag;
    if !message.present(field) {
        return;
    }
    let last = message.last(tag);
    match (field.kind, last) {
        (Kind::Str, Some(Wire::Bytes(b))) => encode_bytes(tag, b, out),
        (Kind::Bool, _) => encode_varint_field(tag, 1, out),
        (Kind::U32 | Kind::OptionalU32, Some(Wire::Varint(v))) => {
            encode_varint_field(tag, u64::from(v as u32), out)
        }
        (Kind::Enum(_), Some(Wire::Varint(v))) => {
            encode_varint_field(tag, i64::from(v as i32) as u64, out)
        }
        (Kind::Strings, _) => {
            for wire in message.all(tag) {
                if let Wire::Bytes(b) = wire {
                    encode_bytes(tag, b, out);
                }
            }
        }
        (Kind::PackedI64 | Kind::PackedU32 | Kind::PackedF64, _) => {
            let mut payload = Vec::new();
            for v in numbers(message.all(tag), field.kind) {
                match field.kind {
                    Kind::PackedF64 => payload.extend_from_slice(&v.to_le_bytes()),
                    Kind::PackedU32 => encode_varint(u64::from(v as u32), &mut payload),
                    _ => encode_varint(v, &mut payload),
                }
            }
            encode_packed(tag, &payload, out);
        }
        (Kind::Message(spec), _) => {
            let merged = EncodedMessage::new(spec, message_parts(message.all(tag)));
            encode_nested(tag, &merged, out);
        }
        (Kind::Messages(spec), _) => {
            for wire in message.all(tag) {
                if let Wire::Bytes(b) = wire {
                    encode_nested(tag, &EncodedMessage::new(spec, vec![b]), out);
                }
            }
        }
        (Kind::OneofMessage(spec), _) => {
            if let Some((_, occurrences)) = message.oneof() {
                let merged = EncodedMessage::new(spec, message_parts(occurrences.into_iter()));
                encode_nested(tag, &merged, out);
            }
        }
        (Kind::OneofI64, Some(Wire::Varint(v))) => encode_varint_field(tag, v, out),
        (Kind::OneofBool, Some(Wire::Varint(v))) => {
            encode_varint_field(tag, u64::from(v != 0), out)
        }
        (Kind::OneofF64, Some(Wire::Fixed64(bits))) => {
            encode_key(tag, WireType::SixtyFourBit, out);
            out.extend_from_slice(&bits.to_le_bytes());
        }
        (Kind::OneofStr, Some(Wire::Bytes(b))) => encode_bytes(tag, b, out),
        // A field of the wrong wire type does not decode: checked before.
        _ => {}
    }
}

/// A message field: key, length, body.
fn encode_nested(tag: u32, message: &EncodedMessage<'_>, out: &mut Vec<u8>) {
    let mut body = Vec::new();
    encode_message(message, &mut body);
    encode_bytes(tag, &body, out);
}

/// The first enum field of the graph encoded in `bytes` whose code has no JSON name, named
/// with its element (`node #3: phase code 9`): proto3 JSON spells enums by name.
pub(crate) fn first_unnamed_enum(bytes: &[u8]) -> Option<String> {
    let graph = EncodedMessage::new(&GRAPH, vec![bytes]);
    GRAPH.fields.iter().find_map(|field| match field.kind {
        Kind::Messages(spec) => {
            graph
                .all(field.tag)
                .enumerate()
                .find_map(|(index, wire)| match wire {
                    Wire::Bytes(b) => unnamed_enum(&EncodedMessage::new(spec, vec![b]))
                        .map(|what| format!("{} #{index}: {what}", singular(field.name))),
                    _ => None,
                })
        }
        _ => unnamed_enum(&graph),
    })
}

/// `values` -> `value`: how a message names one element.
fn singular(plural: &str) -> &str {
    plural.strip_suffix('s').unwrap_or(plural)
}

fn unnamed_enum(message: &EncodedMessage<'_>) -> Option<String> {
    message
        .spec
        .fields
        .iter()
        .find_map(|field| match field.kind {
            Kind::Enum(kind) => match message.last(field.tag) {
                Some(Wire::Varint(v)) if kind.name(v as i32).is_none() => {
                    Some(format!("`{}` code {}", field.json, v as i32))
                }
                _ => None,
            },
            Kind::Message(spec) => unnamed_enum(&EncodedMessage::new(
                spec,
                message_parts(message.all(field.tag)),
            )),
            _ => None,
        })
}

/// Writes the graph encoded in `bytes` (which must decode, with every enum code named) as
/// pretty-printed proto3 JSON with a final newline: the bytes pbjson and
/// `serde_json::to_vec_pretty` make of the decoded message, written one element at a time.
pub(crate) fn write_json(bytes: &[u8], out: impl std::io::Write) -> std::io::Result<()> {
    use serde::Serialize;
    let mut serializer = serde_json::Serializer::pretty(out);
    EncodedMessage::new(&GRAPH, vec![bytes]).serialize(&mut serializer)?;
    serializer.into_inner().write_all(b"\n")
}

impl serde::Serialize for EncodedMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let present: Vec<&'static Field> = self
            .spec
            .fields
            .iter()
            .filter(|f| self.present(f))
            .collect();
        let mut s = serializer.serialize_struct(self.spec.name, present.len())?;
        for field in present {
            s.serialize_field(field.json, &JsonField(self, field))?;
        }
        s.end()
    }
}

/// A string field's bytes (checked to be UTF-8 before).
fn utf8<E: serde::ser::Error>(bytes: &[u8]) -> Result<&str, E> {
    std::str::from_utf8(bytes).map_err(E::custom)
}

/// A present field of an encoded message, serialised as pbjson serialises it.
struct JsonField<'m, 'a>(&'m EncodedMessage<'a>, &'static Field);

impl serde::Serialize for JsonField<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeSeq};
        let JsonField(message, field) = *self;
        let tag = field.tag;
        match (field.kind, message.last(tag)) {
            (Kind::Str | Kind::OneofStr, Some(Wire::Bytes(b))) => {
                serializer.serialize_str(utf8::<S::Error>(b)?)
            }
            (Kind::Bool, _) => serializer.serialize_bool(true),
            (Kind::OneofBool, Some(Wire::Varint(v))) => serializer.serialize_bool(v != 0),
            (Kind::U32 | Kind::OptionalU32, Some(Wire::Varint(v))) => {
                serializer.serialize_u32(v as u32)
            }
            (Kind::Enum(kind), Some(Wire::Varint(v))) => match kind.name(v as i32) {
                Some(name) => serializer.serialize_str(name),
                None => Err(S::Error::custom(format!(
                    "`{}` code {} has no name in JSON",
                    field.json, v as i32
                ))),
            },
            (Kind::OneofI64, Some(Wire::Varint(v))) => serializer.collect_str(&(v as i64)),
            (Kind::OneofF64, Some(Wire::Fixed64(bits))) => {
                JsonF64(f64::from_bits(bits)).serialize(serializer)
            }
            (Kind::Strings, _) => {
                let mut seq = serializer.serialize_seq(None)?;
                for wire in message.all(tag) {
                    if let Wire::Bytes(b) = wire {
                        seq.serialize_element(utf8::<S::Error>(b)?)?;
                    }
                }
                seq.end()
            }
            (Kind::PackedI64 | Kind::PackedU32 | Kind::PackedF64, _) => {
                let mut seq = serializer.serialize_seq(None)?;
                for v in numbers(message.all(tag), field.kind) {
                    match field.kind {
                        Kind::PackedF64 => seq.serialize_element(&JsonF64(f64::from_bits(v)))?,
                        Kind::PackedU32 => seq.serialize_element(&(v as u32))?,
                        _ => seq.serialize_element(&format_args!("{}", v as i64))?,
                    }
                }
                seq.end()
            }
            (Kind::Message(spec), _) => {
                EncodedMessage::new(spec, message_parts(message.all(tag))).serialize(serializer)
            }
            (Kind::OneofMessage(spec), _) => {
                let occurrences = message.oneof().map(|(_, o)| o).unwrap_or_default();
                EncodedMessage::new(spec, message_parts(occurrences.into_iter()))
                    .serialize(serializer)
            }
            (Kind::Messages(spec), _) => {
                let mut seq = serializer.serialize_seq(None)?;
                for wire in message.all(tag) {
                    if let Wire::Bytes(b) = wire {
                        seq.serialize_element(&EncodedMessage::new(spec, vec![b]))?;
                    }
                }
                seq.end()
            }
            _ => Err(S::Error::custom(format!(
                "`{}` has the wrong wire type",
                field.json
            ))),
        }
    }
}
