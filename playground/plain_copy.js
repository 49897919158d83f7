// Loaded with the page (playground/app.py: launch(js=...)). The chat's copy buttons copy a
// message's raw content, and ours can be markup: the token view and n replies side by side are
// one line of HTML (handlers/chat.py, handlers/token_probs.py), and every reply ends with its
// stats line in <sub>. Copying that would paste HTML, so the clipboard gets the text instead;
// any other text passes through untouched.
() => {
  const clipboard = navigator.clipboard;
  if (!clipboard || clipboard.playgroundPlainCopy) return;
  const write = clipboard.writeText.bind(clipboard);
  const blockText = (line) => {
    const html = line
      .replace(/<\/div><div class="pg-reply">/g, '</div>\n\n<div class="pg-reply">')
      .replace(/<\/b><br>/g, "</b>\n")
      .replace(/↵<br>/g, "\n")
      .replace(/<br>/g, "\n");
    return new DOMParser().parseFromString(html, "text/html").body.textContent;
  };
  const plain = (text) =>
    typeof text !== "string"
      ? text
      : text
          .replace(/\n\n<sub>[^<]*<\/sub>/g, "")
          .replace(/^<div class="pg-(?:tokens|replies)">.*$/gm, blockText);
  clipboard.writeText = (text) => write(plain(text));
  clipboard.playgroundPlainCopy = true;
}
