// Shared by the gateway's two pages (inlined where they say so, by gateway/html_pages.py): JSON
// from the gateway with the API key the page asked for once, kept for the browser tab only.
function headers() {
  const key = sessionStorage.getItem("reame-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(path) {
  let response = await fetch(path, { headers: headers() });
  if (response.status === 401) {
    const key = window.prompt("This server needs its API key:");
    if (key) sessionStorage.setItem("reame-key", key);
    response = await fetch(path, { headers: headers() });
  }
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}
