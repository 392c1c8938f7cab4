use std::fmt;

/// Longest msg_id accepted, in bytes: the `VARCHAR(64)` of the `outbox` and `consumed_msg` tables.
pub const MAX_MSG_ID_LEN: usize = 64;

/// A validated message id: non-empty, at most [`MAX_MSG_ID_LEN`] bytes, no whitespace or
/// control characters.
///
/// The same id is the publish-side dedup key (unique in the `outbox` table) and the
/// consume-side idempotency key (`consumed_msg`), so it is built from the business key and
/// the event name, e.g. `order-42:OrderPaid`. An id that does not fit is an error, never
/// truncated: a truncated id could collide with another event's.
///
/// ```
/// use outbox_core::MsgId;
/// assert_eq!(MsgId::new("order-42:OrderPaid").unwrap().as_str(), "order-42:OrderPaid");
/// assert!(MsgId::new("has space").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct MsgId(String);

/// Why a string is not a valid [`MsgId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMsgId {
    /// The id is empty.
    #[error("msg_id is empty")]
    Empty,
    /// The id is longer than [`MAX_MSG_ID_LEN`] bytes. The message shows only its
    /// beginning: ids reach logs and dead-letter reasons, and a foreign producer's may
    /// be megabytes long.
    #[error(
        "msg_id `{}` is {len} bytes long; the limit is {MAX_MSG_ID_LEN}",
        shown(id)
    )]
    TooLong {
        /// The rejected id.
        id: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The id contains whitespace or a control character.
    #[error(
        "msg_id {:?} contains whitespace or a control character at byte {at}",
        shown(id)
    )]
    BadChar {
        /// The rejected id.
        id: String,
        /// Byte offset of the first offending character.
        at: usize,
    },
    /// A part the id is built from is empty: an `#[outbox(id)]` field, a `{field}` of an
    /// id template, or the business key or event type given to [`MsgId::from_parts`].
    /// An empty part would give every such event one id (`:OrderPaid`), and each after
    /// the first would be rejected as a duplicate of it.
    #[error(
        "msg_id part `{part}` is empty: every event with an empty `{part}` would get the same msg_id"
    )]
    EmptyPart {
        /// The field (`order_id`), or `business key` / `event type` for
        /// [`MsgId::from_parts`].
        part: &'static str,
    },
}

impl MsgId {
    /// Validates `id` and wraps it.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidMsgId> {
        let id = id.into();
        if id.is_empty() {
            return Err(InvalidMsgId::Empty);
        }
        if id.len() > MAX_MSG_ID_LEN {
            return Err(InvalidMsgId::TooLong { len: id.len(), id });
        }
        if let Some((at, _)) = id
            .char_indices()
            .find(|(_, c)| c.is_whitespace() || c.is_control())
        {
            return Err(InvalidMsgId::BadChar { id, at });
        }
        Ok(Self(id))
    }

    /// Builds the conventional id `{business_key}:{event_type}`. Neither part may be
    /// empty ([`InvalidMsgId::EmptyPart`]).
    ///
    /// ```
    /// use outbox_core::{InvalidMsgId, MsgId};
    /// assert_eq!(MsgId::from_parts("order-42", "OrderPaid")?.as_str(), "order-42:OrderPaid");
    /// assert_eq!(
    ///     MsgId::from_parts("", "OrderPaid"),
    ///     Err(InvalidMsgId::EmptyPart { part: "business key" })
    /// );
    /// # Ok::<_, InvalidMsgId>(())
    /// ```
    pub fn from_parts(business_key: &str, event_type: &str) -> Result<Self, InvalidMsgId> {
        if business_key.is_empty() {
            return Err(InvalidMsgId::EmptyPart {
                part: "business key",
            });
        }
        if event_type.is_empty() {
            return Err(InvalidMsgId::EmptyPart { part: "event type" });
        }
        Self::new(format!("{business_key}:{event_type}"))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

/// The beginning of a rejected id, for messages: at most [`MAX_MSG_ID_LEN`] bytes (cut at
/// a character boundary) and `…` when there is more.
fn shown(id: &str) -> std::borrow::Cow<'_, str> {
    if id.len() <= MAX_MSG_ID_LEN {
        return id.into();
    }
    let end = (0..=MAX_MSG_ID_LEN)
        .rev()
        .find(|&i| id.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}…", &id[..end]).into()
}

/// One part of a derived id, rendered: an error naming `field` if it renders empty. Used
/// by `#[derive(OutboxEvent)]` for each id field and each `{field}` of a template.
#[doc(hidden)]
pub fn id_part(field: &'static str, value: &dyn fmt::Display) -> Result<String, InvalidMsgId> {
    let part = value.to_string();
    if part.is_empty() {
        return Err(InvalidMsgId::EmptyPart { part: field });
    }
    Ok(part)
}

impl fmt::Display for MsgId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for MsgId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for MsgId {
    type Error = InvalidMsgId;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl TryFrom<&str> for MsgId {
    type Error = InvalidMsgId;
    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl<'de> serde::Deserialize<'de> for MsgId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::new(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_business_ids() {
        let id = MsgId::from_parts("order-42", "OrderPaid").unwrap();
        assert_eq!(id.as_str(), "order-42:OrderPaid");
        assert_eq!(id.to_string(), "order-42:OrderPaid");
        assert!(MsgId::new("租户/订单-1:已支付").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_blank() {
        assert_eq!(MsgId::new(""), Err(InvalidMsgId::Empty));
        let long = "x".repeat(MAX_MSG_ID_LEN + 1);
        assert!(matches!(
            MsgId::new(long),
            Err(InvalidMsgId::TooLong { len: 65, .. })
        ));
        assert!(MsgId::new("x".repeat(MAX_MSG_ID_LEN)).is_ok());
        assert!(matches!(
            MsgId::new("a b"),
            Err(InvalidMsgId::BadChar { at: 1, .. })
        ));
        assert!(matches!(
            MsgId::new("a\tb"),
            Err(InvalidMsgId::BadChar { .. })
        ));
        assert!(matches!(
            MsgId::new("ab\u{7}"),
            Err(InvalidMsgId::BadChar { at: 2, .. })
        ));
    }

    #[test]
    fn empty_parts_are_named() {
        assert_eq!(
            MsgId::from_parts("", "OrderPaid"),
            Err(InvalidMsgId::EmptyPart {
                part: "business key"
            })
        );
        assert_eq!(
            MsgId::from_parts("order-42", ""),
            Err(InvalidMsgId::EmptyPart { part: "event type" })
        );
        assert_eq!(
            id_part("order_id", &""),
            Err(InvalidMsgId::EmptyPart { part: "order_id" })
        );
        assert_eq!(id_part("n", &0).as_deref(), Ok("0"));
        let e = InvalidMsgId::EmptyPart { part: "order_id" }.to_string();
        assert!(e.contains("`order_id` is empty"), "{e}");
    }

    #[test]
    fn multibyte_length_counts_bytes() {
        // 22 three-byte characters = 66 bytes: over the column's limit.
        assert!(matches!(
            MsgId::new("订".repeat(22)),
            Err(InvalidMsgId::TooLong { len: 66, .. })
        ));
    }

    #[test]
    fn deserialize_validates() {
        assert!(serde_json::from_str::<MsgId>("\"ok:Id\"").is_ok());
        assert!(serde_json::from_str::<MsgId>("\"not ok\"").is_err());
    }
}
