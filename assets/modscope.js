// Static behaviour only. Opening a finding's "evidence" must not also navigate to its
// module (the card itself is clickable): keep those clicks away from React's handlers.
document.addEventListener("click", function (e) {
  if (e.target && e.target.closest && e.target.closest(".finding details, .top-finding details")) {
    e.stopPropagation();
  }
}, true);
