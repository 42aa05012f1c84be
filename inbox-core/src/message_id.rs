use std::fmt;
use uuid::Uuid;

/// The deduplication key of a message: stable across every redelivery of it.
///
/// Use the broker's message id or a business id the producer sets once, never a
/// correlation id, a delivery counter or a receive timestamp (those change between
/// deliveries and let duplicates through).
///
/// ```
/// use inbox_core::MessageId;
/// use uuid::Uuid;
///
/// let raw = Uuid::parse_str("0b8f6a2e-5d3c-4f1a-9e7b-2c4d6e8f0a1b").unwrap();
/// let id = MessageId::from(raw);
/// assert_eq!(id.as_uuid(), raw);
/// assert_eq!(id.to_string(), "0b8f6a2e-5d3c-4f1a-9e7b-2c4d6e8f0a1b");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(Uuid);

impl MessageId {
    /// Wraps a UUID as it is.
    pub const fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }

    /// The UUID stored in the inbox.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// Whether this is the nil UUID, which the inbox refuses: it is what an unset id
    /// usually looks like, and every such message would deduplicate against every other.
    pub fn is_nil(&self) -> bool {
        self.0.is_nil()
    }
}

impl From<Uuid> for MessageId {
    fn from(uuid: Uuid) -> Self {
        Self(uuid)
    }
}

impl From<MessageId> for Uuid {
    fn from(id: MessageId) -> Self {
        id.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
