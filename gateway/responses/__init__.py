"""The Responses API's state: response ids, the stored responses (memory, then Redis) and the
conversations kept in them."""
