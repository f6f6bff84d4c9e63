// Renders the node's own /openapi.json with the Swagger UI shipped beside this file.
// Read only: no "Try it out" (the page never holds a secret) and no outside validator.
window.addEventListener("DOMContentLoaded", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#api",
    layout: "BaseLayout",
    presets: [SwaggerUIBundle.presets.apis],
    supportedSubmitMethods: [],
    validatorUrl: null,
    deepLinking: true,
    docExpansion: "list",
    defaultModelsExpandDepth: 0,
  });
});
