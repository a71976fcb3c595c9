"""The chat page served at `/`: plain HTML, CSS and JavaScript files shipped inside the
package (static/), and the router that serves them under a Content-Security-Policy."""
