// Copy buttons: <button type="button" data-copy="ID" hidden> copies the text of the element
// with id ID and says so in the button's status (an element with id ID-status). The buttons
// stay hidden without JavaScript, where the text is selected and copied by hand.
(function () {
  "use strict";

  function copyBySelection(source) {
    var range = document.createRange();
    range.selectNodeContents(source);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    try {
      return document.execCommand("copy");
    } catch (error) {
      return false;
    }
  }

  function copy(button) {
    var source = document.getElementById(button.dataset.copy);
    var status = document.getElementById(button.dataset.copy + "-status");
    if (!source) {
      return;
    }
    var text = source.textContent.trim();
    function say(copied) {
      if (status) {
        status.textContent = copied ? "Copied." : "Could not copy: the text is selected, copy it with your keyboard.";
      }
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { say(true); },
        function () { say(copyBySelection(source)); });
    } else {
      say(copyBySelection(source));
    }
  }

  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    button.hidden = false;
    button.addEventListener("click", function () { copy(button); });
  });
})();
