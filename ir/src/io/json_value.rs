//! Scalar values of a JSON graph read as pbjson reads them (the same values accepted, the
//! same ones refused, at the same place), with errors in plain words that name the field:
//! pbjson's own say "data did not match any variant of untagged enum Content" for a number
//! out of range and "expected expected one of" for a wrong enum.

use std::{fmt, marker::PhantomData, str::FromStr};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// An integer type of the graph's fields, with its range in words.
pub(crate) trait Integer: Sized + FromStr {
    /// "an integer from MIN to MAX".
    const RANGE: &'static str;
    fn from_i64(v: i64) -> Option<Self>;
    fn from_u64(v: u64) -> Option<Self>;
}

impl Integer for u32 {
    const RANGE: &'static str = "an integer from 0 to 4294967295";
    fn from_i64(v: i64) -> Option<Self> {
        u32::try_from(v).ok()
    }
    fn from_u64(v: u64) -> Option<Self> {
        u32::try_from(v).ok()
    }
}

impl Integer for i64 {
    const RANGE: &'static str = "an integer from -9223372036854775808 to 9223372036854775807";
    fn from_i64(v: i64) -> Option<Self> {
        Some(v)
    }
    fn from_u64(v: u64) -> Option<Self> {
        i64::try_from(v).ok()
    }
}

/// An integer of field `field` (its JSON name): a JSON integer, or a string of one (as proto3
/// JSON allows), in `T`'s range.
pub(crate) struct IntegerOf<T> {
    field: &'static str,
    kind: PhantomData<T>,
}

impl<T> Clone for IntegerOf<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for IntegerOf<T> {}

impl<T> IntegerOf<T> {
    pub(crate) fn field(field: &'static str) -> Self {
        IntegerOf {
            field,
            kind: PhantomData,
        }
    }

    fn refuse<E: de::Error>(&self, what: impl fmt::Display) -> E
    where
        T: Integer,
    {
        E::custom(format_args!(
            "`{}` must be {}, not {what}",
            self.field,
            T::RANGE
        ))
    }
}

impl<'de, T: Integer> DeserializeSeed<'de> for IntegerOf<T> {
    type Value = T;

    /// The value is read whole, then judged, as pbjson judges the value it buffered: a refusal
    /// then gets its place from the enclosing object, as pbjson's does (past the object's `}`
    /// when the value is its last member).
    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<T, D::Error> {
        deserializer
            .deserialize_any(ReadInteger(self))?
            .map_err(|what| self.refuse(what))
    }
}

/// Reads an integer of an [`IntegerOf`]: the value, or what was there instead, in words.
struct ReadInteger<T>(IntegerOf<T>);

impl<'de, T: Integer> Visitor<'de> for ReadInteger<T> {
    type Value = Result<T, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` to be {}", self.0.field, T::RANGE)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(T::from_i64(v).ok_or_else(|| v.to_string()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(T::from_u64(v).ok_or_else(|| v.to_string()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Err(v.to_string()))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.parse().map_err(|_| format!("the string `{v}`")))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Err(v.to_string()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Err("null".to_owned()))
    }

    // A list or an object is read to its end before it is refused, as pbjson reads it.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Err("a list".to_owned()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Err("an object".to_owned()))
    }
}

/// The names and numbers of an enum.
pub(crate) trait EnumNames: Copy {
    /// The name of `number`; none for a number the enum does not have.
    fn name(self, number: i32) -> Option<&'static str>;
    /// The number of `name`.
    fn number(self, name: &str) -> Option<i32>;
}

/// An enum value of field `field`: its name, or its number.
pub(crate) struct EnumOf<K> {
    pub(crate) field: &'static str,
    pub(crate) names: K,
}

impl<K: EnumNames> EnumOf<K> {
    fn refuse<E: de::Error>(&self, what: impl fmt::Display) -> E {
        E::custom(format_args!("`{}` must be {self}, not {what}", self.field))
    }

    fn number(&self, v: Option<i32>) -> Option<i32> {
        v.filter(|&v| self.names.name(v).is_some())
    }
}

/// "one of A, B, C": the names, in number order.
impl<K: EnumNames> fmt::Display for EnumOf<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("one of ")?;
        let names = (0..=i32::from(u8::MAX)).filter_map(|v| self.names.name(v));
        for (i, name) in names.enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl<'de, K: EnumNames> DeserializeSeed<'de> for EnumOf<K> {
    type Value = i32;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<i32, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, K: EnumNames> Visitor<'de> for EnumOf<K> {
    type Value = i32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` to be {self}", self.field)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i32, E> {
        self.number(i32::try_from(v).ok())
            .ok_or_else(|| self.refuse(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i32, E> {
        self.number(i32::try_from(v).ok())
            .ok_or_else(|| self.refuse(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<i32, E> {
        self.names
            .number(v)
            .ok_or_else(|| self.refuse(format_args!("`{v}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::graph as pb;

    fn integer<T: Integer>(json: &str) -> Result<T, String> {
        let mut de = serde_json::Deserializer::from_str(json);
        IntegerOf::<T>::field("layer")
            .deserialize(&mut de)
            .map_err(|e| e.to_string())
    }

    #[derive(Clone, Copy)]
    struct Phase;

    impl EnumNames for Phase {
        fn name(self, number: i32) -> Option<&'static str> {
            pb::Phase::try_from(number).ok().map(|p| p.as_str_name())
        }
        fn number(self, name: &str) -> Option<i32> {
            pb::Phase::from_str_name(name).map(|p| p as i32)
        }
    }

    fn phase(json: &str) -> Result<i32, String> {
        let mut de = serde_json::Deserializer::from_str(json);
        EnumOf {
            field: "phase",
            names: Phase,
        }
        .deserialize(&mut de)
        .map_err(|e| e.to_string())
    }

    #[test]
    fn integers_read_as_numbers_or_strings_within_their_range() {
        assert_eq!(integer::<u32>("4294967295"), Ok(u32::MAX));
        assert_eq!(integer::<u32>("\"7\""), Ok(7));
        assert_eq!(integer::<i64>("-3"), Ok(-3));
        // Alone, a refused value has no place: the enclosing object gives it one.
        assert_eq!(
            integer::<u32>("4294967296").unwrap_err(),
            "`layer` must be an integer from 0 to 4294967295, not 4294967296"
        );
        assert_eq!(
            integer::<u32>("-1").unwrap_err(),
            "`layer` must be an integer from 0 to 4294967295, not -1"
        );
        for (json, what) in [
            ("1.5", "not 1.5"),
            ("\"x\"", "not the string `x`"),
            ("null", "not null"),
            ("[1]", "not a list"),
        ] {
            let error = integer::<u32>(json).unwrap_err();
            assert!(error.contains(what), "{error}");
        }
    }

    #[test]
    fn enums_read_by_name_or_number_and_list_their_names_once() {
        assert_eq!(phase("\"PHASE_BACKWARD\""), Ok(2));
        assert_eq!(phase("1"), Ok(1));
        let listed = "one of PHASE_UNSPECIFIED, PHASE_FORWARD, PHASE_BACKWARD";
        assert_eq!(
            phase("\"PHASE_SIDEWAYS\"").unwrap_err(),
            format!("`phase` must be {listed}, not `PHASE_SIDEWAYS` at line 1 column 16")
        );
        assert_eq!(
            phase("9").unwrap_err(),
            format!("`phase` must be {listed}, not 9 at line 1 column 1")
        );
        assert_eq!(
            phase("true").unwrap_err(),
            format!(
                "invalid type: boolean `true`, expected `phase` to be {listed} at line 1 column 4"
            )
        );
    }
}
